"""``finetune preprocess RECIPE --show N``: the first tokenized training rows with the trained tokens marked.

What is shown is what training reads: the ``input_ids`` and ``labels`` stored in the tokenized train split, in the
order the split holds them (the sampler shuffles later), never a re-rendering of the source row. Labels line up
with ``input_ids`` (``labels[i]`` is ``input_ids[i]`` or IGNORE; the loss shifts them by one), so token ``i`` is
trained when ``labels[i] != IGNORE``.

Each token's text is its own decode (special tokens as the tokenizer writes them). Where those pieces do not join
into ``tokenizer.decode(input_ids)`` (a tokenizer that drops a word's leading space when a token is decoded alone,
or a character split over byte tokens), each token's text is what it adds to the decode of the ids before it (a
partial character, shown as U+FFFD, is given to the token that completes it), so the pieces always join into the
text the tokenizer decodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.data.rows import IGNORE
from finetune.errors import DataError

GREEN, RESET = "\x1b[32m", "\x1b[0m"
OPEN, CLOSE = "[[", "]]"  # a trained run's marks where stdout is not a terminal
CAUSAL = ("input_ids", "labels")
SIDES = ("chosen", "rejected")  # preference pairs: chosen_input_ids, chosen_labels, ...
NOT_SHOWN = ("--show covers causal-LM rows (alpaca, chat, completion) and preference pairs; this recipe's train "
             "split is {what}")


@dataclass(frozen=True)
class Entry:
    """One shown sequence: its row in the train split, the side of a preference pair (else None), its tokens."""

    row: int
    side: str | None
    input_ids: list[int]
    labels: list[int]


def pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text of each token, joining into ``tokenizer.decode(ids)`` (see the module's docstring)."""
    ids = list(ids)
    whole = tokenizer.decode(ids)
    alone = [tokenizer.decode([i]) for i in ids]
    if "".join(alone) == whole:
        return alone
    out: list[str] = []
    done = ""
    for k in range(len(ids)):
        text = tokenizer.decode(ids[:k + 1]).rstrip("\ufffd")  # a partial character waits for its last byte
        if text.startswith(done):
            out.append(text[len(done):])
            done = text
        else:
            out.append("")
    if out:
        out[-1] += whole[len(done):] if whole.startswith(done) else ""
    return out


def trained_spans(texts: Sequence[str], labels: Sequence[int]) -> list[list[int]]:
    """[start, end) character offsets of each maximal run of trained tokens in ``"".join(texts)``."""
    spans: list[list[int]] = []
    at = 0
    for text, label in zip(texts, labels, strict=True):
        end = at + len(text)
        if label != IGNORE and text:
            if spans and spans[-1][1] == at:
                spans[-1][1] = end
            else:
                spans.append([at, end])
        at = end
    return spans


def entries(dataset: Any, count: int) -> list[Entry]:
    """The first ``count`` rows of a tokenized train split as shown sequences (a preference pair gives two).
    Raises DataError for a split that holds no causal-LM or preference rows."""
    columns = set(dataset.column_names)
    rows = dataset.select(range(min(count, len(dataset))))
    if all(f"{side}_{name}" in columns for side in SIDES for name in CAUSAL):
        return [Entry(k, side, list(row[f"{side}_input_ids"]), list(row[f"{side}_labels"]))
                for k, row in enumerate(rows) for side in SIDES]
    if set(CAUSAL) <= columns and "images" not in columns:
        return [Entry(k, None, list(row["input_ids"]), list(row["labels"])) for k, row in enumerate(rows)]
    what = ("vision-language chat (image tokens)" if "images" in columns else
            "classification rows" if "label" in columns else "prompt rows (task grpo)" if "prompt_ids" in columns
            else f"of columns {sorted(columns)}")
    raise DataError(NOT_SHOWN.format(what=what))


def json_line(tokenizer: Any, entry: Entry) -> str:
    """One JSON object: the split, row, side (pairs only), decoded text, trained spans, input_ids and labels."""
    texts = pieces(tokenizer, entry.input_ids)
    record: dict[str, Any] = {"split": "train", "row": entry.row}
    if entry.side is not None:
        record["side"] = entry.side
    record.update(text="".join(texts), trained=trained_spans(texts, entry.labels), input_ids=entry.input_ids,
                  labels=entry.labels)
    return json.dumps(record, ensure_ascii=False)


def marked(tokenizer: Any, entry: Entry, *, colour: bool) -> str:
    """The header ``train row K`` (and the pair's side) and the text with each trained run in green (``colour``)
    or between ``[[`` and ``]]``."""
    texts = pieces(tokenizer, entry.input_ids)
    text = "".join(texts)
    start, end = (GREEN, RESET) if colour else (OPEN, CLOSE)
    parts, at = [], 0
    for first, last in trained_spans(texts, entry.labels):
        parts += [text[at:first], start, text[first:last], end]
        at = last
    parts.append(text[at:])
    side = f" ({entry.side})" if entry.side else ""
    return f"train row {entry.row}{side}\n{''.join(parts)}"


def show(tokenizer: Any, dataset: Any, count: int, *, as_json: bool, colour: bool) -> Iterator[str]:
    """The lines ``--show`` prints for the first ``count`` rows: JSON lines, or marked text per row."""
    for entry in entries(dataset, count):
        yield json_line(tokenizer, entry) if as_json else marked(tokenizer, entry, colour=colour)


def short_note(dataset: Any, count: int) -> str | None:
    """The one stderr line when the split holds fewer than ``count`` rows, else None."""
    size = len(dataset)
    if size >= count:
        return None
    return f"--show {count}: the train split holds only {size} row{'s' * (size != 1)}; all of them are shown"
