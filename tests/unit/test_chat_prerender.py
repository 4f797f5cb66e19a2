"""Chat rows rendered in batched template calls (finetune.data.formats.prerender_chats) give exactly what one
template call per render gives, and a batch with a bad row falls back to the row-by-row path (None). The direct
render through the compiled template (TemplateRenderer) gives exactly apply_chat_template's strings, is taken on
the shipped tokenizers, and is not taken (or is overruled by its canary) where it could differ."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.data.formats import TemplateRenderer, chat_renders, prerender_chats, render, render_one

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


ODD = ["naïve café ☕ — 日本語 🙂", "tabs\tand\r\nnewlines\n\n", "  spaced  ", "<|user|> inside", "</s>", "{{ x }}",
       "{% raw %}", "", "\n"]


def _odd_conversations() -> list[list[dict]]:
    """Every CONVERSATION, the odd strings as contents, and messages with None-valued and extra keys (as arrow
    rows of a column whose rows have different keys give them)."""
    out = [[{"role": r, "content": c} for r, c in conv] for conv in CONVERSATIONS]
    for odd in ODD:
        out.append([{"role": "system", "content": odd, "name": None}, {"role": "user", "content": odd},
                    {"role": "assistant", "content": odd, "extra": "x"}])
    return out


@pytest.mark.parametrize("gen", [False, True])
def test_the_direct_render_is_apply_chat_template(chat_tokenizer, gen: bool) -> None:
    """Every prefix of every conversation, through the compiled template directly and through
    apply_chat_template (one call each): identical strings, and the direct path is really taken."""
    conversations = _odd_conversations()
    direct = TemplateRenderer.of(chat_tokenizer, conversations)
    assert direct is not None
    prefixes = [conv[:n] for conv in conversations for n in range(len(conv) + 1)]
    assert direct.render(prefixes, gen) == chat_tokenizer.apply_chat_template(prefixes, tokenize=False,
                                                                              add_generation_prompt=gen)
    for prefix in filter(None, prefixes):  # and one call per conversation (the row-by-row path's calls)
        assert direct.render([prefix], gen) == [
            chat_tokenizer.apply_chat_template(prefix, tokenize=False, add_generation_prompt=gen)]


@pytest.mark.parametrize("odd", [
    {"role": "user", "content": [{"type": "text", "text": "a list"}]},  # content blocks
    {"role": "user", "content": "hi", "reasoning_content": "why"},  # transformers aliases reasoning keys
    {"role": "user", "content": "hi", "thinking": None},
    {"role": "user", "content": "hi", "n": 1},  # a non-str value
])
def test_unusual_messages_go_through_apply_chat_template(chat_tokenizer, odd: dict) -> None:
    rows = _rows()
    assert TemplateRenderer.of(chat_tokenizer, [row["messages"] for row in rows]) is not None
    conversations = [*(row["messages"] for row in rows), [odd, {"role": "assistant", "content": "ok"}]]
    assert TemplateRenderer.of(chat_tokenizer, conversations) is None


def test_an_overridden_apply_chat_template_is_called(chat_tokenizer) -> None:
    class Custom(type(chat_tokenizer)):
        def apply_chat_template(self, *args, **kwargs):  # e.g. a tokenizer class with its own rules
            return super().apply_chat_template(*args, **kwargs)

    custom = copy.copy(chat_tokenizer)
    custom.__class__ = Custom
    assert TemplateRenderer.of(custom, [row["messages"] for row in _rows()]) is None


def test_the_canary_overrules_a_direct_render_that_differs(chat_tokenizer, monkeypatch) -> None:
    """A direct render that differed from apply_chat_template (e.g. a transformers that passes the template more
    variables) is caught on each batched call's first conversation: the batch is rendered by apply_chat_template."""
    conversations = [row["messages"] for row in _rows()]
    want = [{key: render_one(messages, key, chat_tokenizer) for key in chat_renders(messages)}
            for messages in conversations]
    assert prerender_chats(conversations, chat_tokenizer) == want
    real, calls = TemplateRenderer.render, []

    def wrong(self, convs, gen):
        calls.append(gen)
        return [text + "!" for text in real(self, convs, gen)]

    monkeypatch.setattr(TemplateRenderer, "render", wrong)
    assert prerender_chats(conversations, chat_tokenizer) == want
    assert sorted(calls) == [False, True]
