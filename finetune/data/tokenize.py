"""Tokenize checked rows into model inputs, with answer masking and the over-long policy.

The rows go through the batch functions of :mod:`finetune.data.batched` (in ``data.num_proc`` processes) inside
``datasets.Dataset.map``, which caches the result keyed by the rows' cache file (so by the data file, see
:mod:`finetune.data.sources`) and these functions' arguments, so a second run on the same data and tokenizer skips
tokenization. The key also holds a hash of the source of every module that decides a tokenized row (``datasets``
hashes module-level functions by name, not by code), so a change to rendering or masking never reuses a stale
cache.

The output columns get explicit types (:func:`output_features`): left to itself, ``map`` keeps the source
column's type for an output column of the same name, so a csv's text ``label`` column turned the label ids back
into strings. With fixed types the tokenized split is the same whatever file type it came from.

``datasets``' own progress bars and info lines are off while it works (:func:`finetune.data.loading.quiet_datasets`);
a tokenization pass that really runs (not a cache hit) says so on stderr instead (:class:`Progress`).

The cache files are finetune's to check (:mod:`finetune.data.cache`): ``map`` gets finetune's own key for them, a
damaged one is discarded before it is read, whether the pass ran is told by the files it returned, and a full
cache disk is one line naming the cache folder. A Ctrl+C or a SIGTERM during a pass with several processes stops it
as itself: ``datasets``' pool re-raised it as a TimeoutError while it unwound (an internal error).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from finetune.data import batched, cache, prompt_rows, shapes
from finetune.data.batched import Progress
from finetune.data.formats import EVERY_TURN, ChatRule
from finetune.data.loading import check_columns, label_error, quiet_datasets, raw_values
from finetune.data.rows import IGNORE, line_of
from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset, Features

    from finetune.data.prompt_rows import PromptOptions
    from finetune.data.vision import ImageInputs

__all__ = ["CODE_VERSION", "IGNORE", "Progress", "Tokenized", "check_labels", "column", "label_index", "label_names",
           "output_features", "tokenize_rows"]
MAX_LABEL_ID = 1_000_000  # integer ids make max+1 classes: a larger id is a wrong column, not a classifier
# what decides a tokenized row
RENDERING = ("formats.py", "rows.py", "prompts.py", "tokenize.py", "vision.py", "batched.py", "prompt_rows.py",
             "bos.py", "shapes.py")
CODE_VERSION = hashlib.sha256(b"".join(Path(__file__).with_name(name).read_bytes()
                                       for name in RENDERING)).hexdigest()[:16]


@dataclass
class Tokenized:
    """A tokenized split and what was done to fit ``max_seq_len`` (reported to the user); ``cached``: read from
    the cache of an earlier pass (no row was tokenized now)."""

    dataset: Dataset
    truncated: int
    dropped: int
    no_answer: int
    cached: bool = False


def column(dataset: Any, name: str) -> list[Any]:
    """A whole column as Python values. Plain columns are one arrow read: iterating ``dataset[name]`` decodes row
    by row (30 s per 1M rows, on every start); other features (e.g. JSON-typed mixed columns) are decoded."""
    feature = dataset.features.get(name) if hasattr(dataset, "features") else None
    if type(feature).__name__ in ("Value", "ClassLabel"):
        return dataset.with_format("arrow")[name].to_pylist()
    return list(dataset[name])


def _written_as_decimal(raw: Any) -> bool:
    """A label as written in the file that loading turned into a float: a JSON float, or csv text like ``2.0``."""
    if isinstance(raw, float):
        return True
    return isinstance(raw, str) and bool(raw.strip()) and not re.fullmatch(r"\s*[+-]?\d+\s*", raw)


def check_labels(values: list[Any], source: str) -> None:
    """Every label is a name or an integer id >= 0; else raise for the row the user most likely got wrong.

    Loading converts whole columns: ids with one blank csv cell, or one written ``2.0``, all become floats. So a
    missing label is reported before other bad values, and a float that is a whole number only when no other bad
    value exists, at the row where the file holds the decimal.
    """
    bad = [i for i, v in enumerate(values) if type(v) is not str and (type(v) is not int or v < 0)]
    if not bad:
        return

    def rank(i: int) -> int:
        value = values[i]
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return 0
        return 2 if isinstance(value, float) and value.is_integer() else 1

    first = min(bad, key=lambda i: (rank(i), i))
    if rank(first) == 2:
        first = next((i for i, raw in enumerate(raw_values(source, "label")) if _written_as_decimal(raw)), first)
    raise DataError(label_error(values[first], line_of(source, first)) or f"{line_of(source, first)}: bad label")


def label_names(train: Dataset, configured: list[str] | None, source: str) -> list[str]:
    """Label names in id order: the recipe's list, 0..max for integer labels, else sorted names found in train.

    The result is the classifier's set of classes, so fewer than two is refused (the loss would be 0 from the
    first step and nothing would be learned).
    """
    if hasattr(train, "column_names"):
        check_columns(train, "classification", source)
    values = column(train, "label")
    check_labels(values, source)
    if configured:
        names = list(configured)
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise DataError(f"data.labels: {twice!r} is listed twice; give each class one name")
        if len(names) < 2:
            raise DataError(f"data.labels: classification needs at least two labels, got {names}")
        index = label_index(names)
        bad = next((i for i, v in enumerate(values) if str(v) not in index), None)
        if bad is not None:
            raise DataError(f"{line_of(source, bad)}: label {values[bad]!r} is not in data.labels {names}")
        return names
    if all(type(v) is int for v in values):
        top = max(range(len(values)), key=values.__getitem__)
        if values[top] > MAX_LABEL_ID:
            raise DataError(f"{line_of(source, top)}: label id {values[top]} would make a classifier with "
                            f"{values[top] + 1} classes; number the classes from 0 or list their names in data.labels")
        names = [str(i) for i in range(values[top] + 1)]
    elif any(type(v) is int for v in values):
        odd = next(i for i, v in enumerate(values) if type(v) is not type(values[0]))
        raise DataError(f"{line_of(source, odd)}: labels mix integer ids and names ({values[odd]!r} here, "
                        f"{values[0]!r} in the first row); use one kind or set data.labels")
    else:
        names = sorted(set(values))
    if len(names) < 2:
        raise DataError(f"{source}: classification needs at least two distinct labels; found only {values[0]!r} "
                        f"(in {len(values)} rows); add rows of another class or list every class in data.labels")
    return names


def label_index(names: list[str]) -> dict[str, int]:
    """Map both a label's name and its id (as text) to its id; a name that looks like an id means the name
    (string labels "1", "2", "3" are classes 0, 1, 2, not ids 1, 2 and a missing 3)."""
    index = {str(i): i for i in range(len(names))}
    index.update({name: i for i, name in enumerate(names)})
    return index


def output_features(fmt: str) -> Features:
    """Column types of the tokenized split, fixed so they never depend on the source file's column types."""
    from datasets import Features, Sequence, Value  # lazy: heavy

    common = {"input_ids": Sequence(Value("int32")), "overlong": Value("bool"), "n_labels": Value("int64")}
    if fmt == prompt_rows.FORMAT:
        return prompt_rows.output_features()
    if fmt == "classification":
        return Features({**common, "label": Value("int64")})
    if fmt == "preference":
        return Features({"chosen_input_ids": Sequence(Value("int32")), "chosen_labels": Sequence(Value("int64")),
                         "rejected_input_ids": Sequence(Value("int32")), "rejected_labels": Sequence(Value("int64")),
                         "overlong": Value("bool"), "n_labels": Value("int64")})
    text = {**common, "labels": Sequence(Value("int64")), "prompt_ids": Sequence(Value("int64")),
            "reference": Value("string"), "calls": Value("string")}
    if fmt == "vision_chat":
        return Features({**text, "images": Sequence(Value("string")),
                         "image_grids": Sequence(Sequence(Value("int64"))), "n_images": Value("int64")})
    return Features(text)


def tokenize_rows(
    dataset: Dataset, *, fmt: str, tokenizer: Any, max_len: int, overlong: str, add_bos: str,
    train_on_prompt: bool = False, chat: ChatRule = EVERY_TURN,
    labels: list[str] | None = None, source: str = "", images: ImageInputs | None = None, num_proc: int | None = None,
    prompt: PromptOptions | None = None, require: tuple[str, ...] = (),
) -> Tokenized:
    """Tokenize ``dataset``; apply the over-long policy; drop samples left without any answer token. ``images``:
    the model's image processor (vision_chat only); ``add_bos``: ``data.add_bos``, the special tokens before a
    text's tokens (:class:`finetune.data.bos.Lead`; classification texts take the tokenizer's own); ``num_proc``:
    ``data.num_proc`` (see
    :func:`finetune.data.batched.processes`); ``prompt``: the task's options of prompt rows (the room left for a
    completion) and ``require``: the fields each prompt row must have (see :mod:`finetune.data.prompt_rows`);
    ``chat``: which parts of a chat row's assistant turns are trained (:class:`finetune.data.formats.ChatRule`)."""
    if fmt == prompt_rows.FORMAT:
        prompt_rows.check_columns(dataset, source, require)
    else:
        check_columns(dataset, fmt, source)
    if fmt == prompt_rows.FORMAT:
        room = prompt.new_tokens if prompt is not None else 0
        fn, kwargs = prompt_rows.prompt_batch, {"tokenizer": tokenizer, "max_len": max_len - room, "require": require,
                                                "add_bos": add_bos}
    elif fmt == "classification":
        assert labels is not None, "classification needs label names"
        index = label_index(labels)
        values = column(dataset, "label")
        check_labels(values, source)
        bad = next((i for i, v in enumerate(values) if str(v) not in index), None)
        if bad is not None:
            raise DataError(f"{line_of(source, bad)}: label {values[bad]!r} is not one of {labels} "
                            "(the labels found in train, or data.labels)")
        fn, kwargs = batched.classification_batch, {"tokenizer": tokenizer, "max_len": max_len, "label_ids": index}
    elif fmt == "vision_chat":
        if images is None:
            raise DataError(f"{source}: data.format vision_chat needs a vision-language model type (finetune models)")
        fn, kwargs = batched.vision_batch, {"tokenizer": tokenizer, "images": images, "max_len": max_len,
                                            "train_on_prompt": train_on_prompt, "add_bos": add_bos}
    elif fmt == "preference":  # the prompt is always masked: train_on_prompt does not apply (validation refuses it)
        fn, kwargs = batched.preference_table, {"tokenizer": tokenizer, "max_len": max_len, "add_bos": add_bos}
    else:  # reading: the shapes a row may be written in, with their rules (so the cache key holds them)
        fn, kwargs = batched.causal_table, {"fmt": fmt, "tokenizer": tokenizer, "max_len": max_len,
                                            "train_on_prompt": train_on_prompt, "add_bos": add_bos,
                                            "reading": shapes.reading(fmt), "rule": chat}
    procs = batched.processes(num_proc, len(dataset))
    fn_kwargs = {**kwargs, "source": source, "code_version": CODE_VERSION}
    features = output_features(fmt)
    key = cache.key(dataset, fn, fn_kwargs, features)
    before = cache.check_entries(dataset, key, features, source)  # a damaged entry is discarded, with a note
    progress = Progress(source, len(dataset), shared=procs > 1)
    batched.ACTIVE.append(progress)
    workers = batched.workers_die_with_this_process() if procs > 1 else contextlib.nullcontext()
    try:
        with quiet_datasets(), cache.writes(source, "tokenizing"), workers:
            mapped = dataset.map(fn, with_indices=True, batched=True, batch_size=batched.BATCH_ROWS,
                                 num_proc=procs if procs > 1 else None, fn_kwargs=fn_kwargs,
                                 remove_columns=dataset.column_names, features=features, new_fingerprint=key)
    except Exception as exc:
        stop = _stop_behind(exc)
        if stop is None:
            raise
        raise stop from None
    finally:
        batched.ACTIVE.remove(progress)
    progress.finish()
    cached = not cache.tokenized_now(mapped, before)
    # read straight from Arrow into numpy: no Python object per row (memory flat in the row count)
    table = mapped.with_format("arrow")
    over_mask = np.asarray(table["overlong"].to_numpy(), dtype=bool)
    answered = table["n_labels"].to_numpy() > 0
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
                     dropped=over if overlong == "drop" else 0, no_answer=no_answer, cached=cached)


def _stop_behind(exc: BaseException) -> BaseException | None:
    """The stop (Ctrl+C, a stop signal: a BaseException that is no Exception) that ``exc`` was raised while
    handling, if any: ``datasets``' pool raises TimeoutError from the cleanup of one, which must not turn a stop into
    an internal error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if not isinstance(current, Exception):
            return current
        current = current.__cause__ or current.__context__
    return None
