"""Chat rows rendered in batched template calls (finetune.data.formats.prerender_chats) give exactly what one
template call per render gives, and a batch with a bad row falls back to the row-by-row path (None)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.data.formats import chat_renders, prerender_chats, render

ASSETS = Path(__file__).resolve().parents[2] / "finetune" / "assets"
TOKENIZERS = sorted(p.name for p in ASSETS.iterdir() if (p / "tokenizer_config.json").is_file())

U, A, S = "user", "assistant", "system"
CONVERSATIONS = [
    [(U, "hi"), (A, "hello")],
    [(S, "be brief"), (U, "2+2?"), (A, "4")],
    [(U, "a"), (A, "b"), (U, "c"), (A, "d"), (U, "e"), (A, "f")],
    [(U, "q"), (A, "first"), (U, "then?")],
    [(A, "an assistant opens"), (U, "ok"), (A, "  spaced  ")],
]


def _rows() -> list[dict]:
    return [{"messages": [{"role": r, "content": c} for r, c in conv]} for conv in CONVERSATIONS]


@pytest.fixture(scope="module", params=TOKENIZERS)
def chat_tokenizer(request):
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / request.param)
    if not tokenizer.chat_template:
        pytest.skip(f"{request.param} has no chat template")
    return tokenizer


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_batched_renders_equal_one_call_each(chat_tokenizer, train_on_prompt: bool) -> None:
    rows = _rows()
    texts = prerender_chats([row["messages"] for row in rows], chat_tokenizer)
    assert texts is not None
    for row, mine in zip(rows, texts, strict=True):
        assert set(mine) == set(chat_renders(row["messages"]))
        assert render(row, "chat", chat_tokenizer, train_on_prompt, mine) == \
            render(row, "chat", chat_tokenizer, train_on_prompt)


def test_a_bad_row_means_row_by_row(chat_tokenizer) -> None:
    rows = _rows()
    assert prerender_chats([*(row["messages"] for row in rows), "not a list"], chat_tokenizer) is None
    assert prerender_chats([*(row["messages"] for row in rows), [{"content": "no role"}]], chat_tokenizer) is None
