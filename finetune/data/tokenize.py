"""Tokenize checked rows into model inputs, with answer masking and the over-long policy.

``datasets.Dataset.map`` caches the result keyed by the file and these functions' arguments, so a second run
on the same data and tokenizer skips tokenization. The key also holds a hash of this module's and formats.py's
source (``datasets`` hashes module-level functions by name, not by code), so a change to rendering or masking
never reuses a stale cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from finetune.data.formats import render
from finetune.data.loading import check_row, check_rows, line_of
from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

IGNORE = -100
CODE_VERSION = hashlib.sha256(b"".join(Path(__file__).with_name(name).read_bytes()
                                       for name in ("formats.py", "tokenize.py"))).hexdigest()[:16]


@dataclass
class Tokenized:
    """A tokenized split and what was done to fit ``max_seq_len`` (reported to the user)."""

    dataset: Dataset
    truncated: int
    dropped: int
    no_answer: int


def _causal_row(row: dict[str, Any], index: int, *, fmt: str, tokenizer: Any, max_len: int, train_on_prompt: bool,
                source: str, code_version: str = "") -> dict:
    # code_version is unused here: it is part of the map cache key (see the module docstring)
    check_row(row, index, fmt, source)  # inside the cached map: checked once per data/code version
    out = render(row, fmt, tokenizer, train_on_prompt)
    enc = tokenizer(out.text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    labels = [tid if any(start < end_s and end > start_s for start_s, end_s in out.spans) else IGNORE
              for tid, (start, end) in zip(ids, enc["offset_mapping"], strict=True)]
    prompt_ids: list[int] = list(tokenizer(out.prompt, add_special_tokens=False)["input_ids"]) if out.prompt else []
    bos = tokenizer.bos_token_id
    if bos is not None and not out.text.startswith(tokenizer.bos_token or "\0"):
        ids, labels, prompt_ids = [bos, *ids], [IGNORE, *labels], [bos, *prompt_ids]
    if out.add_eos and tokenizer.eos_token_id is not None:
        ids, labels = [*ids, tokenizer.eos_token_id], [*labels, tokenizer.eos_token_id]
    overlong = len(ids) > max_len  # training keeps the start; a generation prompt keeps its end (the cue)
    ids, labels = ids[:max_len], labels[:max_len]
    return {"input_ids": ids, "labels": labels, "prompt_ids": prompt_ids[-max_len:], "reference": out.reference,
            "overlong": overlong, "n_labels": sum(label != IGNORE for label in labels)}


def _classification_row(row: dict[str, Any], index: int, *, tokenizer: Any, max_len: int,
                        label_ids: dict[str, int], source: str, code_version: str = "") -> dict:
    check_row(row, index, "classification", source)
    full = tokenizer(row["text"], truncation=False)["input_ids"]
    overlong = len(full) > max_len
    ids = tokenizer(row["text"], truncation=True, max_length=max_len)["input_ids"] if overlong else full
    return {"input_ids": ids, "label": label_ids[str(row["label"])], "overlong": overlong, "n_labels": 1}


def column(dataset: Any, name: str) -> list[Any]:
    """A whole column as Python values. Plain columns are one arrow read: iterating ``dataset[name]`` decodes row
    by row (30 s per 1M rows, on every start); other features (e.g. JSON-typed mixed columns) are decoded."""
    feature = dataset.features.get(name) if hasattr(dataset, "features") else None
    if type(feature).__name__ in ("Value", "ClassLabel"):
        return dataset.with_format("arrow")[name].to_pylist()
    return list(dataset[name])


def label_names(train: Dataset, configured: list[str] | None, source: str) -> list[str]:
    """Label names in id order: the recipe's list, 0..max for integer labels, else sorted names found in train."""
    values = column(train, "label")
    if any(v is None or isinstance(v, (bool, float)) for v in values):
        check_rows(train, "classification", source)  # names the file, line and field
    if configured:
        names = list(configured)
        known = set(names) | {str(i) for i in range(len(names))}
        bad = next((v for v in values if str(v) not in known), None)
        if bad is not None:
            raise DataError(f"{source}: label {bad!r} is not in data.labels {names}")
        return names
    if all(isinstance(v, int) for v in values):
        return [str(i) for i in range(max(values) + 1)]
    if any(isinstance(v, int) for v in values):
        raise DataError(f"{source}: labels mix integer ids and names; use one kind or set data.labels")
    return sorted(set(values))


def label_index(names: list[str]) -> dict[str, int]:
    """Map both a label's name and its id (as text) to its id."""
    index = {name: i for i, name in enumerate(names)}
    index.update({str(i): i for i in range(len(names))})
    return index


def tokenize_rows(
    dataset: Dataset, *, fmt: str, tokenizer: Any, max_len: int, overlong: str, train_on_prompt: bool = False,
    labels: list[str] | None = None, source: str = "",
) -> Tokenized:
    """Tokenize ``dataset``; apply the over-long policy; drop samples left without any answer token."""
    if fmt == "classification":
        assert labels is not None, "classification needs label names"
        index = label_index(labels)
        bad = next((i for i, v in enumerate(column(dataset, "label")) if str(v) not in index), None)
        if bad is not None:
            raise DataError(f"{line_of(source, bad)}: label {dataset[bad]['label']!r} is not one of {labels} "
                            "(the labels found in train, or data.labels)")
        fn, kwargs = _classification_row, {"tokenizer": tokenizer, "max_len": max_len, "label_ids": index}
    else:
        fn, kwargs = _causal_row, {"fmt": fmt, "tokenizer": tokenizer, "max_len": max_len,
                                   "train_on_prompt": train_on_prompt}
    mapped = dataset.map(fn, with_indices=True, fn_kwargs={**kwargs, "source": source, "code_version": CODE_VERSION},
                         remove_columns=dataset.column_names, desc=f"tokenizing {source}")
    over_mask = np.asarray(column(mapped, "overlong"), dtype=bool)
    answered = np.asarray(column(mapped, "n_labels")) > 0
    dropped_mask = over_mask if overlong == "drop" else np.zeros_like(over_mask)
    kept_mask = answered & ~dropped_mask
    over = int(over_mask.sum())
    no_answer = int((~answered & ~dropped_mask).sum())
    if not kept_mask.all():
        mapped = mapped.select(np.flatnonzero(kept_mask).tolist())
    if not len(mapped):
        raise DataError(f"{source}: no usable samples left after applying data.max_seq_len={max_len}")
    return Tokenized(mapped.remove_columns(["overlong", "n_labels"]),
                     truncated=over if overlong == "truncate" else 0,
                     dropped=over if overlong == "drop" else 0, no_answer=no_answer)
