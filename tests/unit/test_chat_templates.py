"""finetune.config.chat_templates: the named templates render their format's definition (ChatML written plainly
here, rendered by transformers' own apply_chat_template), a value is a name or a file, and a wrong one is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import transformers

from finetune.config import chat_templates
from finetune.errors import ConfigError

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6\nsix"}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "get_weather()"},
     {"role": "tool", "content": "{\"sun\": true}"}, {"role": "assistant", "content": "Sunny."}],
]


def chatml(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """ChatML as its definition writes it: each message is <|im_start|>ROLE, a newline, its content, <|im_end|> and
    a newline; the generation prompt is <|im_start|>assistant and a newline."""
    text = "".join("<|im_start|>" + m["role"] + "\n" + m["content"] + "<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.fixture
def bare(bare_tokenizer: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(bare_tokenizer))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [False, True])
def test_chatml_renders_the_chatml_definition(bare: Any, messages: list[dict[str, str]], gen: bool) -> None:
    bare.chat_template = chat_templates.text_of("chatml")
    assert bare.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == chatml(messages, gen)
    prompt = bare.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == chatml(messages[:-1], True)


def test_a_bare_word_is_a_name_anything_else_a_file() -> None:
    assert chat_templates.is_name("chatml") and chat_templates.is_name("my-template_2")
    for path in ("chat.jinja", "templates/chat", "./chatml", "/abs/chatml", "chat.j2"):
        assert not chat_templates.is_name(path), path


def test_an_unknown_name_is_one_line_listing_the_names() -> None:
    problem = chat_templates.name_problem("chatlm")
    assert problem is not None and "'chatlm' is not a named chat template" in problem
    assert "use one of chatml" in problem and ".jinja" in problem and "\n" not in problem
    assert chat_templates.name_problem("chatml") is None and chat_templates.name_problem("x/t.jinja") is None
    assert "empty" in (chat_templates.name_problem("  ") or "")
    with pytest.raises(ConfigError, match=r"^model\.chat_template: 'chatlm' is not a named chat template"):
        chat_templates.text_of("chatlm")


def test_a_file_is_read_and_a_missing_or_odd_one_is_one_line(tmp_path: Path) -> None:
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    assert chat_templates.text_of(str(template)) == template.read_text(encoding="utf-8")
    assert chat_templates.file_problem(str(template)) is None and chat_templates.file_problem("chatml") is None
    missing = tmp_path / "gone.jinja"
    assert chat_templates.file_problem(str(missing)) == f"model.chat_template: file not found: {missing}"
    with pytest.raises(ConfigError, match=f"^{re.escape(f'model.chat_template: file not found: {missing}')}$"):
        chat_templates.text_of(str(missing))
    assert "is not a file" in (chat_templates.file_problem(str(tmp_path)) or "")
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        chat_templates.text_of(str(latin))


def hermes(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> str:
    """Hermes function calling on ChatML, written plainly: with tools, a system turn (the system message's text and
    a blank line first, when there is one) listing each tool's JSON schema on its own line between <tools> and
    </tools>, between a fixed header and footer; each call as <tool_call>, a newline, {"name": ..., "arguments":
    ...}, a newline, </tool_call>, after the turn's text (a newline between); a tool's result in a "tool" turn
    inside <tool_response> lines; reasoning as <think> lines and a blank line first."""
    out = ""
    rest = messages
    if tools:
        system = messages[0]["content"] + "\n\n" if messages[0]["role"] == "system" else ""
        schemas = "".join("\n" + json.dumps(tool) for tool in tools)
        out += (f"<|im_start|>system\n{system}# Tools\n\nYou may call one or more functions. Their signatures are "
                f"within <tools></tools>:\n<tools>{schemas}\n</tools>\n\nFor each call, return a JSON object with "
                "the function name and arguments within <tool_call></tool_call> tags.<|im_end|>\n")
        rest = messages[1:] if messages[0]["role"] == "system" else messages
    for m in rest:
        if m["role"] == "assistant":
            think = f"<think>\n{m['reasoning_content']}\n</think>\n\n" if m.get("reasoning_content") else ""
            calls = [f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": '
                     f'{json.dumps(c["function"]["arguments"])}}}\n</tool_call>' for c in m.get("tool_calls") or []]
            body = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out += f"<|im_start|>assistant\n{think}{body}<|im_end|>\n"
        elif m["role"] == "tool":
            out += f"<|im_start|>tool\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n"
        else:
            out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
AGENT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny, I checked.", "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]}]


@pytest.mark.parametrize("tools", [None, WEATHER])
@pytest.mark.parametrize("messages", [*CONVERSATIONS[:2], AGENT])
@pytest.mark.parametrize("gen", [False, True])
def test_hermes_renders_the_hermes_definition(bare: Any, messages: list[dict[str, Any]], tools: Any,
                                              gen: bool) -> None:
    bare.chat_template = chat_templates.text_of("hermes")
    assert bare.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen) == \
        hermes(messages, tools, gen)


def test_hermes_trains_the_calls_and_not_the_tools_or_their_results(bare: Any) -> None:
    from finetune.data.formats import render

    bare.chat_template = chat_templates.text_of("hermes")
    row = {"messages": [*AGENT[:4], {"role": "assistant", "content": "Sunny."}], "tools": WEATHER}
    samples = render(row, "chat", bare, False)
    assert len(samples) == 1  # it renders prefix-wise
    spans = [samples[0].text[a:b] for a, b in samples[0].spans]
    assert spans == ['<think>\nLook it up.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                     '{"city": "Paris"}}\n</tool_call><|im_end|>', "Sunny.<|im_end|>"]
