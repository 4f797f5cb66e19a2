"""Chat rows trained on the model makers' own chat templates: the label rule of finetune.data.formats checked by
methods that do not use it.

The corpus is every original chat template the installed ``trl`` package ships (``trl/chat_templates/*.jinja``,
as the model makers published them), read at test time: not the ``*_training`` variants TRL patches with
``{% generation %}`` markers, and not the vision-language ones (their conversations need image parts). Each is
put on the bundled tiny tokenizer (rendering is text; the tokenizer only cuts it into ids).

What is checked, for single-turn, multi-turn, system and reasoning conversations:

- every sample's text is the template's own rendering (``apply_chat_template``) of the conversation up to one of
  its assistant turns: nothing is made up or spliced;
- every assistant turn's content is inside exactly one trained span of one sample (each turn trained once), no
  user or system content is inside one, and a span ends at a non-whitespace end marker after the content;
- reasoning the template writes in a sample's text is trained (it is part of the turn);
- the text before the last turn's trained span is the serving prompt, and the serving prompt is
  ``apply_chat_template(..., add_generation_prompt=True)`` itself, or it less a prefill the template's turns do
  not hold, in which case the template warning says so;
- the labels of the tokenized samples decode to text holding each trained content and no prompt content.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from finetune.data import batched
from finetune.data.batched import rendered
from finetune.data.formats import (
    ends_turns,
    generation_prompt,
    prefill_dropped,
    render,
    stop_ids,
    template_variables,
    template_warnings,
)
from finetune.data.rows import IGNORE
from finetune.errors import DataError

TOKENIZER = Path(__file__).resolve().parents[2] / "finetune" / "assets" / "tiny-llama-tokenizer"
VISION = ("idefics3", "llava_next", "qwen2_5_vl", "qwen3_vl", "smolvlm", "lfm2_2_5_vl")


def _corpus() -> dict[str, Path]:
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        return {}
    folder = Path(spec.origin).parent / "chat_templates"
    return {path.stem: path for path in sorted(folder.glob("*.jinja"))
            if not path.stem.endswith("_training") and not path.stem.startswith(VISION)}


CORPUS = _corpus()
U, A, S = "user", "assistant", "system"
CONVERSATIONS = {
    "single": [(U, "What is two plus two?"), (A, "It is four.")],
    "multi": [(U, "What is two plus two?"), (A, "It is four."), (U, "And three plus three?"), (A, "It is six.")],
    "system": [(S, "Answer briefly."), (U, "What is two plus two?"), (A, "It is four."),
               (U, "And three plus three?"), (A, "It is six.")],
}
REASONING = ["Add two and two.", "Add three and three."]


def _messages(kind: str) -> list[dict[str, str]]:
    if kind == "reasoning":  # the multi-turn conversation with a reasoning trace on each assistant turn
        turns = [{"role": r, "content": c} for r, c in CONVERSATIONS["multi"]]
        for message, trace in zip([m for m in turns if m["role"] == A], REASONING, strict=True):
            message["reasoning_content"] = trace
        return turns
    return [{"role": r, "content": c} for r, c in CONVERSATIONS[kind]]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    if not CORPUS:
        pytest.skip("trl is not installed (a test-only dependency: pip install -e .[dev])")
    out = {}
    for name, path in CORPUS.items():
        tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
        tok.chat_template = path.read_text()
        out[name] = tok
    return out


def _drop(text: str, tail: str) -> str:
    """``text`` less its end ``tail`` (asserted there)."""
    assert text.endswith(tail)
    return text[:len(text) - len(tail)]


def _render(tok: Any, messages: list[dict[str, str]]) -> list[Any]:
    return rendered(lambda: render({"messages": copy.deepcopy(messages)}, "chat", tok, False), "rows.jsonl:1",
                    "the tokenizer's chat template rejects this conversation")


def test_the_corpus_is_there_when_trl_is() -> None:
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed")
    assert len(CORPUS) >= 30 and {"qwen3", "gptoss", "phi3", "deepseekv3", "nemotron_3_nano", "llama3"} <= set(CORPUS)


@pytest.mark.parametrize("kind", ["single", "multi", "system", "reasoning"])
@pytest.mark.parametrize("name", list(CORPUS))
def test_every_turn_is_trained_as_the_template_renders_it(tokenizers: dict[str, Any], name: str, kind: str) -> None:
    tok = tokenizers[name]
    messages = _messages(kind)
    try:
        full = tok.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # the template itself refuses (Gemma: no system role): one line naming its message
        with pytest.raises(DataError) as info:
            _render(tok, messages)
        assert str(info.value) == f"rows.jsonl:1: the tokenizer's chat template rejects this conversation ({exc})"
        return
    turns = [i for i, m in enumerate(messages) if m["role"] == A]
    dropped = prefill_dropped(tok)
    # a turn whose rendering does not go on from the prompt the template serves it (its generation prompt less
    # what no rendered turn holds) cannot be trained as served: refused in one line naming the message
    unservable = [i for i in turns if not tok.apply_chat_template(messages[:i + 1], tokenize=False).startswith(
        _drop(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True), dropped))]
    if unservable:
        with pytest.raises(DataError, match=rf"^rows\.jsonl:1: the chat template writes messages\[{unservable[0]}\]"):
            _render(tok, messages)
        return
    samples = _render(tok, messages)
    renders = {tok.apply_chat_template(messages[:i + 1], tokenize=False): i for i in turns}
    assert samples[-1].text == full
    assert all(sample.text in renders for sample in samples)  # each is the template's own rendering of a prefix
    spans = [sample.text[a:b] for sample in samples for a, b in sample.spans]
    for i in turns:
        assert sum(messages[i]["content"] in span for span in spans) == 1, (i, spans)
    for message in messages:
        if message["role"] != A:
            assert not any(message["content"] in span for span in spans), (message, spans)
    for sample in samples:
        for a, b in sample.spans:
            assert b > a and not sample.text[b - 1].isspace()
            owner = next(m for m in messages if m["role"] == A and m["content"] in sample.text[a:b])
            # the end marker is trained too (a template that writes none after a turn is warned about)
            assert not sample.text[a:b].endswith(owner["content"]) or not ends_turns(tok)
            for trace in REASONING:  # reasoning written in the text is inside the span of its turn, or not at all
                if trace in sample.text[:b] and trace in owner.get("reasoning_content", ""):
                    assert trace in sample.text[a:b]
    last = samples[-1]
    served = last.text[:last.spans[-1][0]]
    assert served == last.prompt == generation_prompt(messages[:-1], tok)
    template_prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert template_prompt == served + dropped
    ends = not full.rstrip().endswith(messages[-1]["content"])  # independently: something follows the last answer
    assert ends == ends_turns(tok)
    assert len(template_warnings(tok)) == bool(dropped) + (not ends)
    assert [sample.reference for sample in samples] == [None] * (len(samples) - 1) + [messages[-1]["content"]]


@pytest.mark.parametrize("name", list(CORPUS))
def test_the_tokenized_labels_hold_each_answer_and_no_prompt(tokenizers: dict[str, Any], name: str) -> None:
    tok = tokenizers[name]
    messages = _messages("multi")
    columns = batched.causal_batch({"messages": [messages]}, [0], fmt="chat", tokenizer=tok, max_len=4096,
                                   train_on_prompt=False, add_bos="auto", source="rows.jsonl")
    trained = [tok.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE])
               for ids, labels in zip(columns["input_ids"], columns["labels"], strict=True)]
    assert sum("It is four." in text for text in trained) == 1 and sum("It is six." in text for text in trained) == 1
    assert not any("two plus two" in text or "three plus three" in text for text in trained)
    assert columns["reference"][-1] == "It is six."


def test_the_known_splitters_give_one_sample_per_turn_and_the_others_one(tokenizers: dict[str, Any]) -> None:
    """Qwen3 (reasoning kept only in the last turn), Phi-3 (an end token only after the last turn) and GPT-OSS
    (``<|return|>`` ends the last turn, ``<|end|>`` the others) render a last turn unlike an earlier one: a sample
    per turn. Llama 3 and Qwen2.5 render conversations prefix-wise: one sample per row, as before."""
    messages = _messages("multi")
    for name in ("qwen3", "phi3", "gptoss"):
        assert len(_render(tokenizers[name], messages)) == 2, name
    for name in ("llama3", "qwen2_5"):
        assert len(_render(tokenizers[name], messages)) == 1, name


def test_a_prefilled_think_is_left_out_of_the_prompt_with_a_warning(tokenizers: dict[str, Any]) -> None:
    """DeepSeek-R1's generation prompt ends with ``<think>\\n`` that its rendered turns (which drop reasoning)
    never hold: the turn is trained right after ``<｜Assistant｜>``, and generation starts there too."""
    tok = tokenizers["deepseek_r1_distill"]
    messages = _messages("single")
    [sample] = _render(tok, messages)
    assert prefill_dropped(tok) == "<think>\n"
    assert sample.prompt.endswith("<｜Assistant｜>") and sample.text[sample.spans[0][0]:].startswith("It is four.")
    [warning] = template_warnings(tok)
    assert "'<think>\\n'" in warning and "\n" not in warning and "model.chat_template" in warning


def test_template_arguments_make_a_consistent_prompt(tokenizers: dict[str, Any]) -> None:
    """Nemotron's generation prompt opens a think block its answer-only turns close at once; with
    ``enable_thinking: false`` (model.chat_template_kwargs, fixed in the template) the two agree: no warning,
    and the prompt is the template's own."""
    from finetune.runtime.modeling import use_template_arguments

    tok = copy.deepcopy(tokenizers["nemotron_3_nano"])
    [warning] = template_warnings(tok)
    assert "enable_thinking" in warning and "model.chat_template_kwargs" in warning
    use_template_arguments(tok, {"enable_thinking": False})
    assert template_warnings(tok) == []
    messages = _messages("single")
    [sample] = _render(tok, messages)
    original = tokenizers["nemotron_3_nano"]
    assert sample.prompt == original.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True,
                                                         enable_thinking=False)
    assert sample.text[sample.spans[0][0]:sample.spans[0][1]].startswith("It is four.")


def test_reasoning_a_template_cannot_serve_is_one_line_naming_the_row(tokenizers: dict[str, Any]) -> None:
    """Qwen3.5's no-think template prompts with an empty think block: a turn given a reasoning trace renders
    another one, which no prompt it serves leads to. Refused in one line, naming the message and the way out."""
    with pytest.raises(DataError) as info:
        _render(tokenizers["qwen3_5_nothink"], _messages("reasoning"))
    message = str(info.value)
    assert message.startswith("rows.jsonl:1: ") and "messages[1]" in message and "\n" not in message
    assert "reasoning" in message and "model.chat_template_kwargs" in message


def test_a_template_that_ends_no_turn_is_warned_about(tokenizers: dict[str, Any]) -> None:
    """GLM-4.5's original template ends an assistant turn only where the next message begins: a last turn is
    trained as rendered (content only), and a warning says the model learns no end from it."""
    tok = tokenizers["glm4moe"]
    assert not ends_turns(tok)
    [warning] = template_warnings(tok)
    assert "no end marker" in warning and "model.chat_template" in warning and "\n" not in warning
    assert all(ends_turns(tokenizers[name]) for name in ("llama3", "qwen3", "gptoss", "phi3", "deepseekv3"))


def test_generation_stops_at_the_templates_end_of_turn(tokenizers: dict[str, Any]) -> None:
    """Where the tokenizer knows the template's end-of-turn marker as one token, generation stops there as at eos
    (Gemma's ``<end_of_turn>`` comes before its ``<eos>``); a marker that is ordinary text, or none, adds nothing."""
    markers = {"gemma3": "<end_of_turn>", "llama3": "<|eot_id|>", "phi3": "<|end|>", "gptoss": "<|return|>",
               "qwen3": "<|im_end|>"}
    for name, marker in markers.items():
        tok = copy.deepcopy(tokenizers[name])
        assert stop_ids(tok) == [tok.eos_token_id]  # the tiny tokenizer has no such token: text, no stop
        tok.add_special_tokens({"additional_special_tokens": list(markers.values())})
        assert stop_ids(tok) == [tok.eos_token_id, tok.convert_tokens_to_ids(marker)], name
    assert stop_ids(tokenizers["glm4moe"]) == [tokenizers["glm4moe"].eos_token_id]  # no end marker at all


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CHAT = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny, 21 degrees", "name": "get_weather", "tool_call_id": "call_1"},
             {"role": "assistant", "content": "It is sunny in Paris."}]


@pytest.mark.parametrize("name", list(CORPUS))
def test_tool_calls_are_trained_and_tool_results_and_schemas_are_not(tokenizers: dict[str, Any], name: str) -> None:
    """Every template of the corpus that renders tools: each sample is the template's own rendering (tools given)
    of a prefix ending in an assistant turn; the call turn's trained text holds the function's name and argument,
    the answer is trained, and no tool result, tool schema or user text is. A template without tool support is
    refused in one line naming the fix."""
    tok = tokenizers[name]
    row = {"messages": copy.deepcopy(TOOL_CHAT), "tools": TOOLS}
    if "tools" not in template_variables(tok):
        with pytest.raises(DataError, match=r"^rows\.jsonl:1: the row has tools, but the chat template never renders "
                                            r"tools .*model\.chat_template"):
            rendered(lambda: render(row, "chat", tok, False), "rows.jsonl:1", "rejects")
        return
    try:
        whole = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False)
    except Exception as exc:  # the template itself refuses this conversation: its message, one line
        with pytest.raises(DataError, match=r"^rows\.jsonl:1: the tokenizer's chat template rejects"):
            rendered(lambda: render(row, "chat", tok, False), "rows.jsonl:1",
                     "the tokenizer's chat template rejects this conversation")
        assert str(exc)
        return
    samples = rendered(lambda: render(row, "chat", tok, False), "rows.jsonl:1", "rejects")
    renders = {tok.apply_chat_template(TOOL_CHAT[:i + 1], tools=TOOLS, tokenize=False) for i in (1, 3)}
    assert samples[-1].text == whole and all(sample.text in renders for sample in samples)
    spans = [sample.text[a:b] for sample in samples for a, b in sample.spans]
    assert sum("get_weather" in span and "Paris" in span for span in spans) == 1, spans
    assert sum("It is sunny in Paris." in span for span in spans) == 1
    for text in ("sunny, 21 degrees", "The weather of a city", "What is the weather"):
        assert not any(text in span for span in spans), (text, spans)
