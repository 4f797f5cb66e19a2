"""The batch functions' short cuts give exactly what one row at a time with a call per text gives.

finetune/data/batched.py takes two short cuts on a fast tokenizer: a sample's labels come from binary searches
over its tokens' offsets (``monotone``), and its generation prompt's ids are the sample's own tokens up to a
special-token match plus the tokens of the short text after it (``seams``). The reference here is the path the
short cuts replace, row by row: the rendered text tokenized with offsets in its own call and every token's offsets
compared with the answer spans, and the prompt tokenized in a second call (``prompts.text_prompt``, what
``finetune generate`` does). Every format, on both shipped tokenizers and on variants that turn each short cut
off, must give IDENTICAL ids, labels and prompt ids; the shipped tokenizers must really take the short cuts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import AddedToken, normalizers, pre_tokenizers

from finetune.data import batched
from finetune.data.formats import render, render_preference
from finetune.data.rows import IGNORE

ASSETS = Path(__file__).resolve().parents[2] / "finetune" / "assets"
ODD = ["naïve café ☕ — 日本語 🙂", "tabs\tand\r\nnewlines\n\n", "  leading and trailing  ", "<|user|> inside",
       "</s> eos inside", "ends with <|assistant|>", "<|im_start|>assistant\n", "x" * 90,
       "a\u0301\u0327 e\u0301 o\u0308\u0323", "\n\nstarts with newlines", "<|assist", "|>\n", "<|tool|>  spaced"]


def _tokenizer(name: str) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(ASSETS / name))


def _variant(kind: str) -> Any:
    """tiny-llama with one rule that turns a short cut off."""
    tok = _tokenizer("tiny-llama-tokenizer")
    backend = tok.backend_tokenizer
    if kind == "nfd":  # Unicode normalization reorders combining marks: offsets may go back
        backend.normalizer = normalizers.NFD()
    elif kind == "rstrip":  # an added token whose match takes the spaces after it
        backend.add_tokens([AddedToken("<|tool|>", rstrip=True, normalized=False)])
    elif kind == "metaspace-first":  # the text's first piece is treated apart
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Metaspace(prepend_scheme="first"), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tok


def _merging() -> Any:
    """A byte-level BPE that merges "\n\n" into one token, and a chat template whose generation prompt ends with
    it: the prompt alone ends with that token, while the whole text (the answer after it) splits "\n", "\n" (the
    pre-tokenizer keeps a run of spaces before a word apart), so a prompt cut from the text's tokens at a clean
    token boundary would be wrong; the seam (``<|assistant|>``) plus its tail tokenized alone is right."""
    from tokenizers import Tokenizer, decoders, models, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(["question one\n\n", "answer\n\n\n\n two", "x:\n\n"] * 50, trainer=trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{%- for m in messages %}{{- '<|' + m['role'] + '|>\\n\\n' + m['content'] + eos_token }}"
                         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n\\n' }}{%- endif %}")
    return tok


TOKENIZERS = {"merging": _merging, "tiny-llama": lambda: _tokenizer("tiny-llama-tokenizer"),
              "tiny-qwen2-vl": lambda: _tokenizer("tiny-qwen2-vl"), "nfd": lambda: _variant("nfd"),
              "rstrip": lambda: _variant("rstrip"),
              "metaspace-first": lambda: _variant("metaspace-first")}


def _chat_rows() -> list[dict[str, Any]]:
    rows = []
    for i, odd in enumerate(ODD):
        user = {"role": "user", "content": f"question {i}: {odd}"}
        answer = {"role": "assistant", "content": f"{odd} answer {i}"}
        rows.append({"messages": [user, answer]})
        rows.append({"messages": [{"role": "system", "content": odd}, user, answer,
                                  {"role": "user", "content": "and " + odd}, {"role": "assistant", "content": odd}]})
    rows.append({"messages": [{"role": "user", "content": "w " * 400}, {"role": "assistant", "content": "long"}]})
    return rows


ROWS = {
    "chat": _chat_rows(),
    "alpaca": [{"instruction": f"do {odd}", "input": inp, "output": out}
               for odd in ODD for inp, out in (("", odd), (odd, "\n" + odd), ("<|user|>", " ok"))],
    "completion": [{"text": odd} for odd in ODD],
}


def _first(text: str, tok: Any, templated: bool, rule: str) -> list[int]:
    """The tokens before a text's own, written plainly: auto: none before a chat template's render, the tokenizer's
    own call's before raw text (none more when the text starts with bos); always: bos unless the text starts with
    it."""
    starts = bool(tok.bos_token) and text.startswith(tok.bos_token)
    if rule == "always":
        return [] if starts or tok.bos_token_id is None else [tok.bos_token_id]
    if templated or starts:
        return []
    own, bare = tok(text)["input_ids"], tok(text, add_special_tokens=False)["input_ids"]
    assert own[len(own) - len(bare):] == bare, "these tokenizers add special tokens before a text only"
    return own[:len(own) - len(bare)]


def _reference(texts: list[tuple[str, tuple[tuple[int, int], ...], bool, bool]], tok: Any, rule: str
               ) -> list[tuple[list, list]]:
    """ids and labels of each (text, spans, add_eos, templated), one tokenizer call per text, every token
    compared."""
    out = []
    for text, spans, add_eos, templated in texts:
        one = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(one["input_ids"])
        labels = [tid if any(s < last and e > first for first, last in spans) else IGNORE
                  for tid, (s, e) in zip(ids, one["offset_mapping"], strict=True)]
        first = _first(text, tok, templated, rule)
        ids, labels = [*first, *ids], [IGNORE] * len(first) + labels
        if add_eos and tok.eos_token_id is not None:
            ids, labels = [*ids, tok.eos_token_id], [*labels, tok.eos_token_id]
        out.append((ids, labels))
    return out


def _columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    return {name: [row.get(name) for row in rows] for name in dict.fromkeys(k for row in rows for k in row)}


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("fmt", list(ROWS))
@pytest.mark.parametrize(("train_on_prompt", "rule"), [(False, "auto"), (True, "auto"), (False, "always")])
@pytest.mark.parametrize("max_len", [4096, 12])
def test_causal_batch_equals_a_call_per_text(name: str, fmt: str, train_on_prompt: bool, rule: str,
                                             max_len: int) -> None:
    tok = TOKENIZERS[name]()
    rows = ROWS[fmt]
    got = batched.causal_batch(_columns(rows), list(range(len(rows))), fmt=fmt, tokenizer=tok, max_len=max_len,
                               train_on_prompt=train_on_prompt, add_bos=rule, source="rows.jsonl")
    outs = [out for row in rows for out in render(copy.deepcopy(row), fmt, tok, train_on_prompt)]
    assert all(o.templated == (fmt == "chat") for o in outs)
    want = _reference([(o.text, o.spans, o.add_eos, o.templated) for o in outs], tok, rule)
    assert got["input_ids"] == [ids[:max_len] for ids, _ in want]
    assert got["labels"] == [labels[:max_len] for _, labels in want]
    cues = [[*_first(o.prompt, tok, o.templated, rule), *tok(o.prompt, add_special_tokens=False)["input_ids"]]
            for o in outs]
    assert got["prompt_ids"] == [cue[-max_len:] for cue in cues]
    assert got["overlong"] == [len(ids) > max_len for ids, _ in want]
    assert got["n_labels"] == [sum(label != IGNORE for label in labels[:max_len]) for _, labels in want]
    assert got["reference"] == [o.reference for o in outs]


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("rule", ["auto", "always"])
def test_preference_batch_equals_a_call_per_text(name: str, rule: str) -> None:
    tok = TOKENIZERS[name]()
    rows = [{"prompt": f"q {odd}", "chosen": odd, "rejected": f"not {odd}"} for odd in ODD]
    rows += [{"chosen": row["messages"][-2:], "rejected": [*row["messages"][-2:-1],
                                                           {"role": "assistant", "content": "no"}]}
             for row in ROWS["chat"]]
    for form in (rows[:len(ODD)], rows[len(ODD):]):  # a batch holds one form (one column layout)
        got = batched.preference_batch(_columns(form), list(range(len(form))), tokenizer=tok, max_len=4096,
                                       add_bos=rule, source="pairs.jsonl")
        pairs = [side for row in form for side in render_preference(copy.deepcopy(row), tok)]
        want = _reference([(p.text, p.spans, p.add_eos, p.templated) for p in pairs], tok, rule)
        assert got["chosen_input_ids"] == [ids for ids, _ in want[::2]]
        assert got["chosen_labels"] == [labels for _, labels in want[::2]]
        assert got["rejected_input_ids"] == [ids for ids, _ in want[1::2]]
        assert got["rejected_labels"] == [labels for _, labels in want[1::2]]


def test_the_shipped_tokenizers_take_both_short_cuts_and_the_variants_do_not() -> None:
    """Both short cuts are on for what ships (else the speed would not come from them), off where a rule breaks
    them; the chat rows of the shipped tokenizers find a seam (a special token) right before their answer."""
    for name in ("tiny-llama", "tiny-qwen2-vl", "merging"):
        tok = TOKENIZERS[name]()
        assert batched.monotone(tok) and batched.seams(tok), name
        rows = ROWS["chat"]
        outs = [out for row in rows for out in render(copy.deepcopy(row), "chat", tok, False)]
        found = [batched._seam(o.text, len(o.prompt), ids, enc, batched.seams(tok))
                 for o, (ids, enc) in zip(outs, batched.encodings([o.text for o in outs], tok), strict=True)]
        assert all(seam is not None for seam in found), name
    assert not batched.monotone(TOKENIZERS["nfd"]())
    assert not batched.seams(TOKENIZERS["rstrip"]()) and batched.monotone(TOKENIZERS["rstrip"]())
    assert not batched.seams(TOKENIZERS["metaspace-first"]())
    split = TOKENIZERS["tiny-llama"]()
    split.split_special_tokens = True
    split.backend_tokenizer.encode_special_tokens = True
    assert not batched.seams(split)


def test_labels_by_binary_search_equal_every_token_compared() -> None:
    """Spans starting and ending inside tokens, between them, on multi-byte characters, empty, and past the end."""
    tok = TOKENIZERS["tiny-llama"]()
    text = "<|user|>\n  naïve 日本語 🙂🙂 a\u0301\u0327\n\n\t<|assistant|>\n ok  </s>\n"
    [(ids, enc)] = batched.encodings([text], tok)
    cuts = range(len(text) + 2)
    for first in cuts:
        for last in cuts[first::3]:
            spans = ((first, last),)
            assert batched._labels(ids, enc, spans, True) == batched.answer_labels(ids, enc.offsets, spans)
    two = ((2, 9), (20, 31))
    assert batched._labels(ids, enc, two, True) == batched.answer_labels(ids, enc.offsets, two)


@pytest.mark.parametrize("fmt", ["chat", "preference"])
def test_the_tables_the_map_writes_hold_the_columns_with_the_output_types(fmt: str) -> None:
    """causal_table / preference_table (what tokenize_rows' map calls) are the batch functions' columns, typed as
    the output features type them (so the writer's cast to those features changes nothing)."""
    from finetune.data.tokenize import output_features

    tok = TOKENIZERS["tiny-llama"]()
    if fmt == "chat":
        rows, kwargs = ROWS["chat"], {"fmt": "chat", "max_len": 64, "train_on_prompt": False, "add_bos": "auto"}
        pair = batched.causal_batch, batched.causal_table
    else:
        rows = [{"prompt": f"q {odd}", "chosen": odd, "rejected": "no"} for odd in ODD]
        kwargs = {"max_len": 64, "add_bos": "auto"}
        pair = batched.preference_batch, batched.preference_table
    columns = pair[0](_columns(rows), list(range(len(rows))), tokenizer=tok, source="rows.jsonl", **kwargs)
    table = pair[1](_columns(rows), list(range(len(rows))), tokenizer=tok, source="rows.jsonl", **kwargs)
    assert table.to_pydict() == columns
    assert {f.name: f.type for f in table.schema} == {f.name: f.type for f in output_features(fmt).arrow_schema}
