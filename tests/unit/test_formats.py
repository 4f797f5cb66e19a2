"""finetune.data.formats: a chat row's prompt is the tokenizer's chat template with the generation prompt, and a
tokenizer without a chat template is a DataError, not a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from finetune.data.formats import generation_prompt, render, render_preference
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
