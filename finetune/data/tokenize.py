"""Tokenize checked rows into model inputs, with answer masking and the over-long policy.

``datasets.Dataset.map`` caches the result keyed by the file and these functions' arguments, so a second run
on the same data and tokenizer skips tokenization. The key also holds a hash of this module's and formats.py's
source (``datasets`` hashes module-level functions by name, not by code), so a change to rendering or masking
never reuses a stale cache.

The output columns get explicit types (:func:`output_features`): left to itself, ``map`` keeps the source
column's type for an output column of the same name, so a csv's text ``label`` column turned the label ids back
into strings. With fixed types the tokenized split is the same whatever file type it came from.

``datasets``' own progress bars and info lines are off while it works (:func:`finetune.data.loading.quiet_datasets`);
a tokenization pass that really runs (not a cache hit) says so on stderr instead (:class:`Progress`).
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import numpy as np

from finetune import hooks
from finetune.data import prompts, vision
from finetune.data.formats import Rendered, render, render_preference
from finetune.data.loading import check_columns, check_row, label_error, quiet_datasets, raw_values
from finetune.data.prompts import starts_with_bos
from finetune.data.rows import IGNORE, error_detail, line_of
from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset, Features

    from finetune.data.vision import ImageInputs

_R = TypeVar("_R")
MAX_LABEL_ID = 1_000_000  # integer ids make max+1 classes: a larger id is a wrong column, not a classifier
RENDERING = ("formats.py", "rows.py", "prompts.py", "tokenize.py", "vision.py")  # what decides a tokenized row
CODE_VERSION = hashlib.sha256(b"".join(Path(__file__).with_name(name).read_bytes()
                                       for name in RENDERING)).hexdigest()[:16]


class Progress:
    """Progress of one tokenization pass, as plain lines on stderr (``datasets``' bars are off).

    ``map`` calls the row function only when its cache misses, so the first row tick is the moment real work
    starts: one line then says what is being tokenized, a line every ``every_s`` seconds gives the count and
    rate, and, if the pass was long enough to report progress, a last line gives its total time. A cache hit
    prints nothing. The row functions reach the active pass through the module-level :data:`_ACTIVE`, because
    ``datasets`` hashes them (for the cache key) by name, so they cannot carry this object as an argument.
    """

    def __init__(self, source: str, total: int, *, every_s: float = 30.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source, self.total, self.every_s = source, total, every_s
        self.done = 0
        self._stream, self._clock = stream, clock
        self._started = 0.0
        self._next = 0.0
        self._reported = False

    def tick(self) -> None:
        """One row tokenized."""
        now = self._clock()
        if self.done == 0:
            self._started, self._next = now, now + self.every_s
            self._say(f"tokenizing {self.source}: {self.total} rows (cached for later runs)")
            hooks.fire("tokenizing", source=self.source)  # a test seam: a real pass starts (never on a cache hit)
        self.done += 1
        if now >= self._next:
            rate = self.done / max(now - self._started, 1e-9)
            self._say(f"tokenizing {self.source}: {self.done}/{self.total} rows ({100 * self.done / self.total:.0f}%), "
                      f"{rate:.0f} rows/s")
            self._next, self._reported = now + self.every_s, True

    def finish(self) -> None:
        """Say how long a pass that reported progress took."""
        if self._reported:
            self._say(f"tokenized {self.source}: {self.done} rows in {self._clock() - self._started:.0f}s")

    def _say(self, text: str) -> None:
        print(text, file=self._stream or sys.stderr, flush=True)


_ACTIVE: list[Progress] = []  # the pass in progress (at most one), see Progress


def _tick() -> None:
    if _ACTIVE:
        _ACTIVE[-1].tick()


@dataclass
class Tokenized:
    """A tokenized split and what was done to fit ``max_seq_len`` (reported to the user)."""

    dataset: Dataset
    truncated: int
    dropped: int
    no_answer: int


def _encode(out: Rendered, tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids of a rendered sample and its labels (the id where a token starts inside an answer span, else
    IGNORE); the bos token first by the prompts' rule (:func:`finetune.data.prompts.starts_with_bos`), eos last
    where the format adds it."""
    enc = tokenizer(out.text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    labels = [tid if any(start < end_s and end > start_s for start_s, end_s in out.spans) else IGNORE
              for tid, (start, end) in zip(ids, enc["offset_mapping"], strict=True)]
    if not starts_with_bos(out.text, tokenizer):
        ids, labels = [tokenizer.bos_token_id, *ids], [IGNORE, *labels]
    if out.add_eos and tokenizer.eos_token_id is not None:
        ids, labels = [*ids, tokenizer.eos_token_id], [*labels, tokenizer.eos_token_id]
    return ids, labels


def _rendered(render_row: Callable[[], _R], where: str, what: str) -> _R:
    """``render_row()``; anything but a DataError it raises (e.g. a chat template's ``raise_exception("roles must
    alternate ...")``) becomes one DataError line, ``where: what (detail)``."""
    try:
        return render_row()
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{where}: {what} ({error_detail(exc)})") from None


def _causal_row(row: dict[str, Any], index: int, *, fmt: str, tokenizer: Any, max_len: int, train_on_prompt: bool,
                source: str, code_version: str = "") -> dict:
    # code_version is unused here: it is part of the map cache key (see the module docstring)
    _tick()
    check_row(row, index, fmt, source)  # inside the cached map: checked once per data/code version
    what = "the tokenizer's chat template rejects this conversation" if fmt == "chat" else "cannot render this row"
    out = _rendered(lambda: render(row, fmt, tokenizer, train_on_prompt), line_of(source, index), what)
    ids, labels = _encode(out, tokenizer)
    overlong = len(ids) > max_len  # training keeps the start; a generation prompt keeps its end (the cue)
    ids, labels = ids[:max_len], labels[:max_len]
    prompt = prompts.text_prompt(out.prompt, tokenizer, max_len)  # out.prompt of chat: prompts.chat_text
    return {"input_ids": ids, "labels": labels, "prompt_ids": prompt.ids, "reference": out.reference,
            "overlong": overlong, "n_labels": sum(label != IGNORE for label in labels)}


def _vision_row(row: dict[str, Any], index: int, *, tokenizer: Any, images: ImageInputs, max_len: int,
                train_on_prompt: bool, source: str, code_version: str = "") -> dict:
    """A vision_chat row: rendered as a chat row, each image placeholder repeated once per image feature, image
    tokens never trained on, cut (when over-long) only between images; ``images`` (absolute paths) and
    ``image_grids`` record every image of the prompt, ``n_images`` how many the (cut) inputs hold."""
    _tick()
    check_row(row, index, "vision_chat", source)
    where = line_of(source, index)
    messages = row["messages"]
    paths = [vision.resolve(ref, source) for ref in vision.image_refs(row)]
    grids = images.grids([vision.open_image(path, where) for path in paths], where, paths)
    counts = [images.tokens(grid) for grid in grids]
    conversation = vision.for_template(messages)
    out = _rendered(lambda: render({"messages": conversation}, "chat", tokenizer, train_on_prompt), where,
                    "the tokenizer's chat template rejects this conversation")
    vision.check_placeholders(out.text, images.image_token, len(paths), where)
    out = vision.expand(Rendered(out.text, out.spans, out.prompt, vision.text_of(messages[-1]["content"]),
                                 out.add_eos), images.image_token, counts)
    ids, labels = _encode(out, tokenizer)
    labels = [IGNORE if tid == images.image_token_id else label for tid, label in zip(ids, labels, strict=True)]
    cut, kept = vision.fit(ids, images.image_token_id, counts, max_len)
    # as generate renders it; a prompt whose kept end would leave out an image stays whole (cuts_image)
    prompt = prompts.vision_prompt(prompts.vision_text(messages[:-1], tokenizer), tokenizer, images, grids, where,
                                   max_len)
    return {"input_ids": ids[:cut], "labels": labels[:cut], "prompt_ids": prompt.ids, "reference": out.reference,
            "images": [str(path) for path in paths], "image_grids": grids, "n_images": kept,
            "overlong": len(ids) > max_len, "n_labels": sum(label != IGNORE for label in labels[:cut])}


def _answer_tokens(labels: list[int]) -> int:
    """Next-token targets of one sequence: labels after the first position that are not IGNORE."""
    return sum(label != IGNORE for label in labels[1:])


def _preference_row(row: dict[str, Any], index: int, *, tokenizer: Any, max_len: int, source: str,
                    code_version: str = "") -> dict:
    """A preference pair as the columns of the data contract: ``chosen_input_ids``, ``chosen_labels``,
    ``rejected_input_ids``, ``rejected_labels`` (labels: the ids of answer tokens, IGNORE on the prompt). Each
    sequence keeps its start when cut to ``max_len``, so the prompt stays whole where it fits; ``n_labels`` is the
    smaller answer count of the two, so a pair with no answer token left on either side is skipped, and so is a
    pair whose two sides are the same tokens once cut (its loss is ln 2 whatever the model: nothing to learn)."""
    _tick()
    check_row(row, index, "preference", source)
    chosen, rejected = _rendered(lambda: render_preference(row, tokenizer), line_of(source, index),
                                 "the tokenizer's chat template rejects this pair")
    out: dict[str, Any] = {"overlong": False, "n_labels": 0}
    counts = []
    for side, rendered in (("chosen", chosen), ("rejected", rejected)):
        ids, labels = _encode(rendered, tokenizer)
        out["overlong"] |= len(ids) > max_len
        out[f"{side}_input_ids"], out[f"{side}_labels"] = ids[:max_len], labels[:max_len]
        counts.append(_answer_tokens(labels[:max_len]))
    same = out["chosen_input_ids"] == out["rejected_input_ids"] and out["chosen_labels"] == out["rejected_labels"]
    out["n_labels"] = 0 if same else min(counts)
    return out


def _classification_row(row: dict[str, Any], index: int, *, tokenizer: Any, max_len: int,
                        label_ids: dict[str, int], source: str, code_version: str = "") -> dict:
    _tick()
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
    from datasets import Features, Sequence, Value

    common = {"input_ids": Sequence(Value("int32")), "overlong": Value("bool"), "n_labels": Value("int64")}
    if fmt == "classification":
        return Features({**common, "label": Value("int64")})
    if fmt == "preference":
        return Features({"chosen_input_ids": Sequence(Value("int32")), "chosen_labels": Sequence(Value("int64")),
                         "rejected_input_ids": Sequence(Value("int32")), "rejected_labels": Sequence(Value("int64")),
                         "overlong": Value("bool"), "n_labels": Value("int64")})
    text = {**common, "labels": Sequence(Value("int64")), "prompt_ids": Sequence(Value("int64")),
            "reference": Value("string")}
    if fmt == "vision_chat":
        return Features({**text, "images": Sequence(Value("string")),
                         "image_grids": Sequence(Sequence(Value("int64"))), "n_images": Value("int64")})
    return Features(text)


def tokenize_rows(
    dataset: Dataset, *, fmt: str, tokenizer: Any, max_len: int, overlong: str, train_on_prompt: bool = False,
    labels: list[str] | None = None, source: str = "", images: ImageInputs | None = None,
) -> Tokenized:
    """Tokenize ``dataset``; apply the over-long policy; drop samples left without any answer token. ``images``:
    the model's image processor (vision_chat only)."""
    check_columns(dataset, fmt, source)
    if fmt == "classification":
        assert labels is not None, "classification needs label names"
        index = label_index(labels)
        values = column(dataset, "label")
        check_labels(values, source)
        bad = next((i for i, v in enumerate(values) if str(v) not in index), None)
        if bad is not None:
            raise DataError(f"{line_of(source, bad)}: label {values[bad]!r} is not one of {labels} "
                            "(the labels found in train, or data.labels)")
        fn, kwargs = _classification_row, {"tokenizer": tokenizer, "max_len": max_len, "label_ids": index}
    elif fmt == "vision_chat":
        if images is None:
            raise DataError(f"{source}: data.format vision_chat needs a vision-language model type (finetune models)")
        fn, kwargs = _vision_row, {"tokenizer": tokenizer, "images": images, "max_len": max_len,
                                   "train_on_prompt": train_on_prompt}
    elif fmt == "preference":  # the prompt is always masked: train_on_prompt does not apply (validation refuses it)
        fn, kwargs = _preference_row, {"tokenizer": tokenizer, "max_len": max_len}
    else:
        fn, kwargs = _causal_row, {"fmt": fmt, "tokenizer": tokenizer, "max_len": max_len,
                                   "train_on_prompt": train_on_prompt}
    progress = Progress(source, len(dataset))
    _ACTIVE.append(progress)
    try:
        with quiet_datasets():
            mapped = dataset.map(fn, with_indices=True,
                                 fn_kwargs={**kwargs, "source": source, "code_version": CODE_VERSION},
                                 remove_columns=dataset.column_names, features=output_features(fmt))
    finally:
        _ACTIVE.remove(progress)
    progress.finish()
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
