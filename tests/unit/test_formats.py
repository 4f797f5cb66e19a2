"""finetune.data.formats: a chat row's prompt is the tokenizer's chat template with the generation prompt, and a
tokenizer without a chat template is a DataError, not a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from finetune.data.formats import ChatRule, generation_prompt, render, render_preference
from finetune.errors import DataError
from tests.data_files import CHAT_TWO_TURNS

TOKENIZER = Path(__file__).resolve().parents[2] / "finetune" / "assets" / "tiny-llama-tokenizer"


def test_chat_render_prompt_is_template_with_generation_prompt(tok: Any) -> None:
    [out] = render(CHAT_TWO_TURNS, "chat", tok, train_on_prompt=False)
    assert out.prompt == tok.apply_chat_template(CHAT_TWO_TURNS["messages"][:-1], tokenize=False,
                                                 add_generation_prompt=True)
    assert out.prompt.endswith("<|assistant|>\n")
    assert out.reference == "f"
    assert not out.add_eos  # the template ends assistant turns with </s> itself
    assert [out.text[a:b] for a, b in out.spans] == ["d</s>", "f</s>"]


def test_chat_without_template_is_a_data_error_naming_the_key_that_fixes_it(tok: Any) -> None:
    """Every render that needs a template (a chat row, a chat preference pair, a prompt written as messages) says
    in one line that the tokenizer has none and that model.chat_template gives one."""
    bare = AutoTokenizer.from_pretrained(str(TOKENIZER))
    bare.chat_template = None
    pair = {"chosen": CHAT_TWO_TURNS["messages"],
            "rejected": [*CHAT_TWO_TURNS["messages"][:-1], {"role": "assistant", "content": "g"}]}
    for call in (lambda: render(CHAT_TWO_TURNS, "chat", bare, train_on_prompt=False),
                 lambda: render_preference(pair, bare),
                 lambda: generation_prompt(CHAT_TWO_TURNS["messages"][:-1], bare)):
        with pytest.raises(DataError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and "has none" in message and "set model.chat_template" in message, message
        assert "chatml" in message and ".jinja" in message


REASONED = {"messages": [{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "Four.", "reasoning_content": "two and two make four"},
                         {"role": "user", "content": "3+3?"},
                         {"role": "assistant", "content": "Six.", "reasoning_content": "three and three make six"}]}
REASONING_TEMPLATE = ("{%- for m in messages %}<|{{ m.role }}|>\n{%- if m.reasoning_content %}<think>"
                      "{{ m.reasoning_content }}</think>{%- endif %}{{ m.content }}</s>\n{%- endfor %}"
                      "{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}")


def _trained_text(samples: list) -> list[str]:
    return [sample.text[a:b] for sample in samples for a, b in sample.spans]


def test_the_last_turn_only_and_a_message_of_its_own(tok: Any) -> None:
    """data.train_turns: last trains the last assistant turn; a message's train: true still trains its turn, and
    train: false keeps the last one as context."""
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    assert _trained_text(render(row, "chat", tok, False)) == ["b</s>", "d</s>"]
    assert _trained_text(render(row, "chat", tok, False, rule=ChatRule(last_only=True))) == ["d</s>"]
    forced = {"messages": [*row["messages"][:1], {**row["messages"][1], "train": True}, *row["messages"][2:]]}
    assert _trained_text(render(forced, "chat", tok, False, rule=ChatRule(last_only=True))) == ["b</s>", "d</s>"]
    kept = {"messages": [*row["messages"][:3], {**row["messages"][3], "train": False}]}
    assert _trained_text(render(kept, "chat", tok, False)) == ["b</s>"]


def test_reasoning_is_trained_unless_the_recipe_says_not(tok: Any) -> None:
    """data.train_reasoning: false leaves each trace's own characters out of its turn's trained text (the
    template's tags and the answer stay trained)."""
    import copy

    reasoning = copy.deepcopy(tok)
    reasoning.chat_template = REASONING_TEMPLATE
    assert _trained_text(render(REASONED, "chat", reasoning, False)) == [
        "<think>two and two make four</think>Four.</s>", "<think>three and three make six</think>Six.</s>"]
    assert _trained_text(render(REASONED, "chat", reasoning, False, rule=ChatRule(reasoning=False))) == [
        "<think>", "</think>Four.</s>", "<think>", "</think>Six.</s>"]


def test_a_tool_call_turn_may_leave_its_content_out(tok: Any) -> None:
    """The OpenAI shape writes a call turn without ``content``: its sample has no text reference, and its calls are
    what the tool_calls metric compares."""
    import copy

    from finetune.config.chat_templates import HERMES

    hermes = copy.deepcopy(tok)
    hermes.chat_template = HERMES
    call = {"type": "function", "function": {"name": "now", "arguments": {}}}
    row = {"messages": [{"role": "user", "content": "time?"}, {"role": "assistant", "tool_calls": [call]}],
           "tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]}
    [sample] = render(row, "chat", hermes, False)
    assert sample.reference is None and sample.calls == '[["now", {}]]'
    assert _trained_text([sample]) == ['<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>']
