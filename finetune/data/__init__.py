"""Data: load + check rows, render formats, tokenize with masking, mix sources, and the resumable sampler."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from finetune.config.schema import CAUSAL_FORMATS, DataConfig, DataSource, TrainSource
from finetune.data import detect, local, mapping, prompt_rows
from finetune.data.formats import ChatRule, template_warnings
from finetune.data.loading import check_columns, load_raw
from finetune.data.mixing import Mixture
from finetune.data.prompt_rows import PromptOptions
from finetune.data.streaming import TrainStream, open_stream, peek_split
from finetune.data.tokenize import Tokenized, check_labels, column, label_names, tokenize_rows
from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset


@dataclass
class Part:
    """One source of a split as tokenized: which key named it, what it is, and what fitting max_seq_len did."""

    key: str  # data.train, or data.train[1] when the split is a list of sources
    name: str  # the file, or the hub dataset with its subset and split
    tokenized: Tokenized
    weight: float = 1.0
    draws: int = 0  # samples per mixture epoch (mixtures only)


@dataclass
class DataBundle:
    """Tokenized train and eval splits; ``labels`` are the classification label names in id order.

    A split given as several sources is their concatenation; ``train_parts`` / ``eval_parts`` say where each came
    from. ``mixture`` is set when ``data.train`` is a weighted mixture (see :mod:`finetune.data.mixing`): the
    sampler then maps stream positions through it, and ``train_size`` is a mixture epoch."""

    train: Tokenized | None
    eval: Tokenized | None
    labels: list[str] | None
    mixture: Mixture | None = None
    train_parts: list[Part] = field(default_factory=list)
    eval_parts: list[Part] = field(default_factory=list)
    stream: TrainStream | None = None  # data.streaming: the training stream (``train`` holds its first samples)
    prompt_room: int = 0  # prompt rows: the tokens each prompt leaves for its completion (its task's max_new_tokens)
    template_warnings: list[str] = field(default_factory=list)  # the chat template's (formats.template_warnings)
    detected: list[str] = field(default_factory=list)  # a line per source whose format was read from its columns
    room_key: str = "grpo.max_new_tokens"  # the recipe key of prompt_room, as the lines name it

    @property
    def train_size(self) -> int:
        """Samples in one epoch of the training stream (the data cursor's epoch length); 0 for data.streaming,
        whose length is unknown."""
        if self.stream is not None:
            return 0
        if self.mixture is not None:
            return self.mixture.epoch_size
        assert self.train is not None
        return len(self.train.dataset)

    def notes(self, max_seq_len: int) -> list[str]:
        """train.log lines about the data: the mixture (sources, rows, draws per epoch) and, per split (per source
        when a split is a list of sources), what was truncated, dropped or skipped to fit ``max_seq_len``."""
        lines: list[str] = []
        if self.stream is not None:
            return [f"data: data.train is streamed ({len(self.stream.sources)} source(s)), tokenized while training; "
                    "its truncated/dropped counts are not known ahead"]
        if self.mixture is not None:
            shares = ", ".join(f"{p.key} {p.name}: {p.draws} of {len(p.tokenized.dataset)} rows (weight {p.weight:g})"
                               for p in self.train_parts)
            lines.append(f"data: mixture of {len(self.train_parts)} sources, {self.mixture.epoch_size} samples per "
                         f"epoch: {shares}")
        for _, source, counts in self._counted():
            prefix = f"{source}: " if source else ""
            if self.prompt_room and (counts.truncated or counts.dropped):
                lines.append(f"data: {prefix}{counts.truncated} prompts truncated (their end kept), "
                             f"{counts.dropped} dropped (longer than data.max_seq_len - {self.room_key} = "
                             f"{max_seq_len - self.prompt_room} tokens)")
            elif counts.truncated or counts.dropped or counts.no_answer:
                lines.append(f"data: {prefix}{counts.truncated} truncated, {counts.dropped} dropped (longer than "
                             f"data.max_seq_len={max_seq_len}), {counts.no_answer} without answer tokens skipped")
        return lines

    def warnings(self, max_seq_len: int) -> list[str]:
        """The lines a user must see on stderr, not only in train.log: a split (or source) of which at least half the
        rows are longer than what a sample may hold (``data.max_seq_len``, less a prompt row's completion room),
        with the counts and the fix. Truncated rows train on their start only, dropped ones not at all: a limit
        below most rows is usually a mistake (a recipe copied from a model with a longer context, or the wrong
        column). A streamed split's counts are not known ahead. And the chat template's warnings, where the data is
        rendered with a template (:func:`finetune.data.formats.template_warnings`)."""
        lines = list(self.template_warnings)
        if self.stream is not None:
            return lines
        limit = max_seq_len - self.prompt_room
        key = f"data.max_seq_len - {self.room_key}" if self.prompt_room else "data.max_seq_len"
        for split, source, counts in self._counted():
            over = counts.truncated + counts.dropped
            rows = len(counts.dataset) + counts.dropped + counts.no_answer
            if over and 2 * over >= rows:
                lines.append(f"warning: {source or split}: {over} of {rows} rows are longer than {key} = {limit} "
                             f"tokens ({counts.truncated} truncated, {counts.dropped} dropped); raise "
                             "data.max_seq_len if the model's context allows, or check the rows")
        return lines

    def _counted(self) -> Iterator[tuple[str, str | None, Tokenized]]:
        """What fitting max_seq_len did, per split (``data.train``, ``data.eval``) or, when a split is a list of
        sources, per source (named ``data.train[1] b.jsonl``; None for a single source)."""
        for split, whole, parts in (("data.train", self.train, self.train_parts),
                                    ("data.eval", self.eval, self.eval_parts)):
            if whole is None:
                continue
            if parts:
                yield from ((split, f"{p.key} {p.name}", p.tokenized) for p in parts)
            else:
                yield split, None, whole

def source_name(source: DataSource) -> str:
    """How messages name a source: its path, plus the subset and split when they are not the defaults (the name
    :func:`load_raw` places the source's rows under, for their ``file:line``)."""
    return local.name_of(source.path, source.subset, source.split)


def _load(source: DataSource, found: list[str], key: str) -> tuple[DataSource, Dataset]:
    """The raw rows of one source, with the columns its format needs, and the source with its format: the
    recipe's, or read from the columns (:mod:`finetune.data.detect`; the line saying so is added to ``found``,
    ``key`` naming the source)."""
    raw = mapping.apply(load_raw(source.path, source.subset, source.split), source.columns, source.message_keys,
                        source_name(source))  # the source's own names for its fields, read as finetune's
    if source.format is None:  # validation left it to the columns: a causal LM's sft
        fmt, shape = detect.detect(raw.column_names, raw.features, frozenset(CAUSAL_FORMATS), source_name(source))
        source = source.model_copy(update={"format": fmt})
        found.append(detect.describe(key, source_name(source), shape, len(raw)))
    if source.format == prompt_rows.FORMAT:  # two row forms: checked by prompt_rows (with the fields they need)
        prompt_rows.check_columns(raw, source_name(source))
    else:
        check_columns(raw, source.format, source_name(source))
    return source, raw


def _labels(raws: list[Dataset], sources: list[TrainSource], configured: list[str] | None) -> list[str]:
    """Classification label names over every training source, in id order (see :func:`label_names`).

    One source: exactly :func:`label_names`. Several: each source's labels are checked against its own file
    (file:line), then the names come from ``data.labels`` or from all sources together."""
    if len(raws) == 1:
        return label_names(raws[0], configured, source_name(sources[0]))
    if configured:  # every label of every source is one of data.labels
        names = [label_names(raw, configured, source_name(s)) for raw, s in zip(raws, sources, strict=True)]
        return names[0]
    values: list[Any] = []
    kinds: dict[bool, str] = {}
    for i, (raw, source) in enumerate(zip(raws, sources, strict=True)):
        own = column(raw, "label")
        check_labels(own, source_name(source))
        for is_id in {type(v) is int for v in own}:
            kinds.setdefault(is_id, f"data.train[{i}] {source_name(source)}")
        values += own
    if len(kinds) > 1:
        raise DataError(f"data.train: {kinds[True]} labels by integer ids but {kinds[False]} by names; use one kind "
                        "in every source or list the classes in data.labels")
    return label_names({"label": values}, None, "data.train")


def _concatenate(parts: list[Part], key: str) -> Tokenized:
    """One split from its sources' tokenized rows, in source order, with the fitting counts summed."""
    from datasets import concatenate_datasets  # lazy: heavy

    if len(parts) == 1:
        return parts[0].tokenized
    try:
        dataset = concatenate_datasets([p.tokenized.dataset for p in parts])
    except (ValueError, TypeError):  # formats of different tasks tokenize into different columns
        columns = "; ".join(f"{p.key}: {', '.join(p.tokenized.dataset.column_names)}" for p in parts)
        raise DataError(f"{key}: these sources tokenize into different columns ({columns}); mix only sources "
                        "whose formats belong to one task") from None
    return Tokenized(dataset, truncated=sum(p.tokenized.truncated for p in parts),
                     dropped=sum(p.tokenized.dropped for p in parts),
                     no_answer=sum(p.tokenized.no_answer for p in parts),
                     cached=all(p.tokenized.cached for p in parts))


def _prompt_needs(source: DataSource, prompt: PromptOptions | None, *, train: bool) -> dict[str, Any]:
    """The fields a prompt source's rows must have (train or eval rows); nothing for other formats."""
    if source.format != prompt_rows.FORMAT or prompt is None:
        return {}
    return {"require": prompt.require if train else prompt.eval_require}


def _number(tokenized: Tokenized, source: DataSource, read: int, rows: int) -> int:
    """Number a prompt source's rows after the ``read`` rows of its split's sources before it; the rows read so
    far, this source's included."""
    if source.format == prompt_rows.FORMAT:
        tokenized.dataset = prompt_rows.shift_index(tokenized.dataset, read)
    return read + rows


def load_splits(cfg: DataConfig, tokenizer: Any, *, need_train: bool = True, images: Any = None,
                labels: list[str] | None = None, seed: int = 0, prompt: PromptOptions | None = None) -> DataBundle:
    """Load, check and tokenize the recipe's splits (the eval split only when ``need_train`` is False); ``images``:
    the model's :class:`finetune.data.vision.ImageInputs` (vision_chat data). ``labels``: the classification label
    names a checkpoint or export recorded (with ``need_train`` False the train files are then not read at all).

    Each source is loaded, checked (errors name its own file and line) and tokenized with its own format, under
    the same data.max_seq_len and data.overlong; a split of several sources is their concatenation. With
    data.streaming the training split is a :class:`finetune.data.streaming.TrainStream` (``seed``: train.seed, its
    shuffle and mixing choices), nothing of it is read ahead but its first samples, and ``train`` holds those.
    ``prompt``: task grpo's options for prompt rows (:meth:`PromptOptions.of` the recipe): the room each prompt
    leaves for its completion, and the fields (``answer``) its train and eval rows must have."""
    train_sources = cfg.train_sources()
    known = labels is not None and not need_train  # recorded with the model: the train files are not read
    found: list[str] = []  # what was read from the columns of sources whose format was left out
    listed = not isinstance(cfg.train, str)
    loaded = [] if known or cfg.streaming else [_load(source, found, f"data.train[{i}]" if listed else "data.train")
                                                 for i, source in enumerate(train_sources)]
    if loaded:
        train_sources = [source for source, _ in loaded]  # each with its format
    raws = [raw for _, raw in loaded]
    classification = train_sources[0].format == "classification"  # the schema keeps them apart from the others
    if not known:  # a stream's label names are data.labels (the schema requires them)
        labels = (cfg.labels if cfg.streaming else _labels(raws, train_sources, cfg.labels)) if classification \
            else None
    common = {"tokenizer": tokenizer, "max_len": cfg.max_seq_len, "overlong": cfg.overlong, "add_bos": cfg.add_bos,
              "train_on_prompt": cfg.train_on_prompt, "chat": ChatRule.of(cfg), "labels": labels, "images": images,
              "num_proc": cfg.num_proc, "prompt": prompt}
    train, mixture, train_parts, stream = None, None, [], None
    if need_train and cfg.streaming:  # nothing read ahead: the stream tokenizes while training
        stream = open_stream(cfg, tokenizer, seed=seed, names=[source_name(s) for s in train_sources],
                             images=images, labels=labels)
        train = peek_split(stream)
    elif need_train:
        read = 0  # rows of the sources before this one (prompt rows are numbered through the split)
        for i, (raw, source) in enumerate(zip(raws, train_sources, strict=True)):
            tokenized = tokenize_rows(raw, fmt=source.format, source=source_name(source), **common,
                                      **_prompt_needs(source, prompt, train=True))
            read = _number(tokenized, source, read, len(raw))
            train_parts.append(Part(f"data.train[{i}]" if listed else "data.train", source_name(source), tokenized,
                                    source.weight))
        train = _concatenate(train_parts, "data.train")
        if len(train_parts) > 1 or train_sources[0].weight != 1:  # one source of weight 1: the plain stream
            mixture = Mixture.from_weights([len(p.tokenized.dataset) for p in train_parts],
                                           [p.weight for p in train_parts])
            for part, draws in zip(train_parts, mixture.draws, strict=True):
                part.draws = draws
    evaluation, eval_parts = None, []
    eval_sources = cfg.eval_sources()
    read = 0
    read_sources = list(itertools.zip_longest(train_sources, raws))  # (source, its rows when read ahead)
    for i, source in enumerate(eval_sources):
        # eval metrics measure the answers, whatever train_on_prompt says for training
        source, raw = _load(source, found, f"data.eval[{i}]" if not isinstance(cfg.eval, str) else "data.eval")
        read_sources.append((source, raw))
        tokenized = tokenize_rows(raw, fmt=source.format, source=source_name(source),
                                  **{**common, "train_on_prompt": False}, **_prompt_needs(source, prompt, train=False))
        read = _number(tokenized, source, read, len(raw))
        eval_parts.append(Part(f"data.eval[{i}]" if not isinstance(cfg.eval, str) else "data.eval",
                               source_name(source), tokenized))
    if eval_parts:
        evaluation = _concatenate(eval_parts, "data.eval")
    templated = any(_templated(source, raw) for source, raw in read_sources)
    return DataBundle(train, evaluation, labels, mixture,
                      train_parts if listed else [], eval_parts if not isinstance(cfg.eval, str) else [], stream,
                      prompt.new_tokens if prompt is not None and cfg.format == prompt_rows.FORMAT else 0,
                      template_warnings(tokenizer) if templated else [], found,
                      prompt.room_key if prompt is not None else PromptOptions.room_key)


def _templated(source: DataSource, raw: Dataset | None) -> bool:
    """Whether a source's rows go through the chat template: chat rows, and prompt or preference rows written as
    messages (``raw``: the source as read, when it was read ahead; else its format decides)."""
    if source.format in ("chat", "vision_chat"):
        return True
    if source.format not in (prompt_rows.FORMAT, "preference"):
        return False
    if raw is None:
        return True
    names = ("messages", "prompt") if source.format == prompt_rows.FORMAT else ("chosen",)
    return any(detect.holds_lists(raw.features.get(name)) for name in names)


__all__ = ["DataBundle", "Part", "PromptOptions", "load_splits", "source_name"]
