"""``data.streaming``: the training split read as a stream and tokenized on the fly, with an exact cursor.

For corpora larger than the disk cache. Nothing is tokenized ahead: each source's rows are read in file order,
``CHUNK_ROWS`` at a time, and go through the same batch functions the cached path maps
(:mod:`finetune.data.batched`: the same row checks, masks and ``file:line`` errors), then through the same
over-long policy and answer check as :func:`finetune.data.tokenize.tokenize_rows`. The pipeline, per optimizer
step, is deterministic given the seed:

- **Sources** (:class:`SourceStream`). A JSON lines file is read from a byte offset (:class:`JsonlRows`); parquet,
  csv, json and arrow files and hub datasets through ``datasets``' ``streaming=True`` (:class:`DatasetRows`, which
  resumes at its own saved shard and offset). A source that ends starts over (its next pass), so the stream never
  ends; a pass that yields no usable sample is an error. With ``data.shuffle`` each source feeds a shuffle buffer of
  ``data.shuffle_buffer`` samples: every draw takes a seeded random slot and puts the source's next sample in it.
- **Mixing** (:class:`TrainStream`). Each sample comes from source ``i`` with probability ``weight_i / sum``: the
  ``n``-th choice is a function of (seed, n) alone. One source is never drawn for.
- **Packing** (``data.packing``). Incoming samples are packed greedily into rows of at most ``data.max_seq_len``
  tokens (a sample that does not fit starts the next row); a packed row is then one unit of the global batch, so
  ``train.global_batch_size`` counts packed rows, and a micro-batch's rows are collated as one padding-free row as
  without streaming (:class:`finetune.data.batching.PackingCollator`).

**The cursor** is this whole state: per source the reader's position, its pass, the tokenized samples of the last
chunk not yet taken, the shuffle buffer and its draw count; the number of mixing choices; the sample a packed row
left over. :meth:`TrainStream.state_dict` gives it as JSON (a checkpoint object, ``data_stream.json``), and a run
resumed from it continues at the next unseen sample, bit for bit as a straight run
(tests/integration/test_streaming.py). Every rank reads and tokenizes the whole stream and keeps its share of
each step (the contiguous split of :class:`finetune.data.batching.StreamSampler`), so the state is the same on
every rank and does not depend on the process count. Reading and tokenizing run in the training process, or,
with ``data.num_workers`` > 0, in one DataLoader worker process that reads ahead: it runs the same pipeline from
the same cursor and hands on each tokenized chunk in the order the training process will ask for it, and the
training process shuffles, mixes, packs and collates them. Only new samples cross between the processes (a state
snapshot per step would carry the whole shuffle buffer: 15 MB for 1,000 samples of 2,048 tokens), and the cursor a
checkpoint saves is the training process's own, exactly the steps taken.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections import deque
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from finetune.config.schema import CAUSAL_FORMATS, DataConfig, DataSource
from finetune.data import batched, local, shapes
from finetune.data.formats import ChatRule
from finetune.data.loading import (
    BUILDERS,
    check_file,
    check_header,
    check_regular,
    label_error,
    quiet_datasets,
    scan_jsonl,
)
from finetune.data.rows import IGNORE, error_detail, line_of
from finetune.data.tokenize import Tokenized, label_index
from finetune.errors import DataError

CHUNK_ROWS = 64  # rows tokenized in one call of a batch function (their leftover samples are part of the cursor)
BLOCK = 4096  # random numbers drawn per seed-sequence block
MIX_STREAM, SHUFFLE_STREAM = 2, 3  # seed-sequence kinds, apart from finetune.data.mixing's 0 and 1
PEEK = 4  # samples of the first source shown to the probe and `finetune preprocess` (read, not consumed)

Row = tuple[int, dict[str, Any]]  # (row index in its file, the row)
Sample = dict[str, Any]
Chunk = tuple[int, list[Sample], dict[str, Any], bool]  # rows read, their samples, position after, pass ended


@lru_cache(maxsize=16)
def _block(seed: int, kind: int, source: int, block: int) -> np.ndarray:
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, kind, source, block])))
    return generator.random(BLOCK)


def uniform(seed: int, kind: int, source: int, n: int) -> float:
    """The ``n``-th number in [0, 1) of the stream (seed, kind, source): a function of these alone, so a resumed
    run needs only the count ``n``, never a generator's state."""
    return float(_block(seed, kind, source, n // BLOCK)[n % BLOCK])


# ---------------------------------------------------------------------------------------------------- readers


class JsonlRows:
    """A local JSON lines file, read from a byte offset: a position is ``{"offset", "index"}``."""

    def __init__(self, path: str) -> None:
        check_file(path)
        self.path = path

    def start(self) -> dict[str, int]:
        """The position of the first row."""
        return {"offset": 0, "index": 0}

    def read(self, position: dict[str, int], count: int) -> tuple[list[Row], dict[str, int], bool]:
        """Up to ``count`` rows from ``position``, the position after them, and whether the file ended."""
        offset, index = position["offset"], position["index"]
        rows: list[Row] = []
        with open(self.path, "rb") as handle:  # binary: lines end at \n only, as for the cached path
            handle.seek(offset)
            while len(rows) < count:
                raw = handle.readline()
                if not raw:
                    return rows, {"offset": offset, "index": index}, True
                rows.append((index, self._parse(raw, index)))
                offset, index = offset + len(raw), index + 1
        return rows, {"offset": offset, "index": index}, False

    def _parse(self, raw: bytes, index: int) -> dict[str, Any]:
        """One line as a JSON object; anything else is the one-line error the cached path gives for that line
        (:func:`finetune.data.loading.scan_jsonl` finds it: every earlier line parsed)."""
        try:
            text = raw.decode("utf-8").removeprefix("\ufeff" if index == 0 else "")
            value = json.loads(text) if text.strip() else None  # a blank line: the scan words it
        except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            value = None
        if isinstance(value, dict):
            return value
        scan_jsonl(self.path, kinds=False)
        raise DataError(f"{self.path}:{index + 1}: expected a JSON object")


class DatasetRows:
    """Rows through ``datasets``' streaming (``load_dataset(..., streaming=True)``): a local parquet, csv, json or
    arrow file, or a hub dataset's split. A position is ``{"index", "datasets"}``: the row index and the
    IterableDataset's own ``state_dict()`` after that row (its shard and offset), so reading elsewhere than where
    the open stream is (a resume, a new pass) restarts the iteration there without reading, or downloading, the
    rows before it."""

    def __init__(self, source: DataSource, name: str) -> None:
        self.source, self.name = source, name
        self.suffix = Path(source.path).suffix
        check_regular(source.path)  # a named pipe or a device (a link to /dev/zero) is refused, whatever its name
        if self.suffix in BUILDERS:
            check_file(source.path)
            if self.suffix == ".csv":
                check_header(source.path)
        elif Path(source.path).exists():
            raise DataError(f"{source.path}: unsupported data file type; use one of {', '.join(BUILDERS)}")
        self._dataset: Any = None  # the IterableDataset, opened once (load_dataset costs seconds; a pass is an iter)
        self._rows: Iterator[dict[str, Any]] | None = None
        self._at = -1

    def start(self) -> dict[str, Any]:
        """The position of the first row."""
        return {"index": 0, "datasets": None}

    def _open(self, position: dict[str, Any]) -> Iterator[dict[str, Any]]:
        import datasets  # lazy: heavy

        if self._dataset is None:
            with quiet_datasets():
                if self.suffix in BUILDERS:
                    self._dataset = datasets.load_dataset(BUILDERS[self.suffix], data_files=self.source.path,
                                                          split="train", streaming=True)
                else:
                    self._dataset = datasets.load_dataset(self.source.path, name=self.source.subset,
                                                          split=self.source.split, streaming=True)
            self._start = self._dataset.state_dict()
        self._dataset.load_state_dict(position["datasets"] or self._start)
        return iter(self._dataset)

    def read(self, position: dict[str, Any], count: int) -> tuple[list[Row], dict[str, Any], bool]:
        """Up to ``count`` rows from ``position``, the position after them, and whether the data ended."""
        index = position["index"]
        try:
            if self._rows is None or self._at != index:
                self._rows, self._at = self._open(position), index
            rows = [(index + i, dict(row)) for i, row in enumerate(itertools.islice(self._rows, count))]
            saved = self._dataset.state_dict()  # as of the last row read
        except DataError:
            raise
        except Exception as exc:  # datasets and pyarrow raise many types; the user gets one line
            self._rows = None
            what = f"as {self.suffix[1:]}" if self.suffix in BUILDERS else "as a streamed hub dataset"
            after = f" after row {index}" if index else ""
            raise DataError(f"{self.name}: cannot be read {what}{after} ({error_detail(exc)})") from None
        self._at = index + len(rows)
        return rows, {"index": self._at, "datasets": saved}, len(rows) < count


# ------------------------------------------------------------------------------------------------- tokenizing


def row_function(fmt: str, cfg: DataConfig, tokenizer: Any, images: Any, labels: list[str] | None
                 ) -> tuple[Callable[..., dict[str, list]], dict[str, Any]]:
    """The batch function of :mod:`finetune.data.batched` for ``fmt`` and its arguments, as tokenize_rows picks
    them (training samples: ``train_on_prompt`` as configured)."""
    if fmt == "classification":
        assert labels is not None, "the schema requires data.labels for a classification stream"
        return batched.classification_batch, {"tokenizer": tokenizer, "max_len": cfg.max_seq_len,
                                              "label_ids": label_index(labels)}
    if fmt == "vision_chat":
        if images is None:
            raise DataError("data.format vision_chat needs a vision-language model type (finetune models)")
        return batched.vision_batch, {"tokenizer": tokenizer, "images": images, "max_len": cfg.max_seq_len,
                                      "train_on_prompt": cfg.train_on_prompt, "add_bos": cfg.add_bos}
    if fmt == "preference":
        return batched.preference_batch, {"tokenizer": tokenizer, "max_len": cfg.max_seq_len, "add_bos": cfg.add_bos}
    assert fmt in CAUSAL_FORMATS, fmt
    return batched.causal_batch, {"fmt": fmt, "tokenizer": tokenizer, "max_len": cfg.max_seq_len,
                                  "train_on_prompt": cfg.train_on_prompt, "add_bos": cfg.add_bos,
                                  "reading": shapes.reading(fmt),
                                  "rule": ChatRule.of(cfg)}


def tokenize_chunk(rows: list[Row], fn: Callable[..., dict[str, list]], kwargs: dict[str, Any], *, source: str,
                   overlong: str, labels: list[str] | None = None) -> list[Sample]:
    """The training samples of a chunk of rows, in order: each row checked, rendered and masked by ``fn``; an
    over-long sample dropped (``overlong: drop``) and one without answer tokens skipped, as the cached path does.
    ``labels``: classification label names (a row's label must be one of them, checked as tokenize_rows does)."""
    if labels is not None:
        index = label_index(labels)
        for number, row in rows:
            value = row.get("label")
            if label_error(value, line_of(source, number)) is None and str(value) not in index:
                raise DataError(f"{line_of(source, number)}: label {value!r} is not one of {labels} (the labels "
                                "found in train, or data.labels)")
    names = list(dict.fromkeys(name for _, row in rows for name in row))  # a row without a field reads it as None
    batch = {name: [row.get(name) for _, row in rows] for name in names}
    columns = fn(batch, [index for index, _ in rows], source=source, **kwargs)
    out: list[Sample] = []
    for k in range(len(columns["n_labels"])):
        if (overlong == "drop" and columns["overlong"][k]) or columns["n_labels"][k] <= 0:
            continue
        out.append({name: values[k] for name, values in columns.items() if name not in ("overlong", "n_labels")})
    return out


# ---------------------------------------------------------------------------------------------------- streams


class SourceStream:
    """One source's endless stream of samples: its passes in file order, through a shuffle buffer when
    ``buffer`` > 0. Its cursor is :meth:`state_dict`."""

    def __init__(self, number: int, name: str, reader: JsonlRows | DatasetRows,
                 tokenize: Callable[[list[Row]], list[Sample]], *, seed: int, buffer: int, max_len: int) -> None:
        self.number, self.name, self.reader, self.tokenize = number, name, reader, tokenize
        self.seed, self.buffer_size, self.max_len = seed, buffer, max_len
        self.feed: Callable[[int], Chunk] | None = None  # set: chunks come from a worker (TrainStream.batches)
        self.record: Callable[[Chunk], None] | None = None  # set in the worker: each chunk read is handed on
        self.restart()

    def restart(self) -> None:
        """Back to the start of the stream: the first pass's first row, nothing buffered or drawn."""
        self.load_state_dict({"position": self.reader.start(), "passes": 0, "rows": 0, "kept": 0, "queue": [],
                              "buffer": [], "draws": 0})

    def state_dict(self) -> dict[str, Any]:
        """Where this source is: JSON, with copies of the pending samples (samples are never changed in place)."""
        return {"position": dict(self.position), "passes": self.passes, "rows": self.rows, "kept": self.kept,
                "queue": list(self.queue), "buffer": list(self.buffer), "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position, self.passes = dict(state["position"]), int(state["passes"])
        self.rows, self.kept, self.draws = int(state["rows"]), int(state["kept"]), int(state["draws"])
        self.queue: deque[Sample] = deque(state["queue"])
        self.buffer: list[Sample] = list(state["buffer"])

    def in_order(self) -> Sample:
        """The next sample in file order (the next pass's first after the last): tokenizes the next chunk when
        the last one's samples are taken."""
        while not self.queue:
            chunk = self.feed(self.number) if self.feed is not None else self._read()
            read, samples, self.position, ended = chunk
            self.rows, self.kept = self.rows + read, self.kept + len(samples)
            self.queue.extend(samples)
            if ended:
                if not self.kept:
                    raise DataError(f"{self.name}: no rows" if not self.rows else
                                    f"{self.name}: no usable samples left after applying data.max_seq_len="
                                    f"{self.max_len}")
                self.position, self.passes, self.rows, self.kept = self.reader.start(), self.passes + 1, 0, 0
        return self.queue.popleft()

    def _read(self) -> Chunk:
        """The next chunk from the reader: (rows read, their samples, the position after them, whether the
        pass ended)."""
        rows, position, ended = self.reader.read(self.position, CHUNK_ROWS)
        chunk = (len(rows), self.tokenize(rows) if rows else [], position, ended)
        if self.record is not None:
            self.record(chunk)
        return chunk

    def next(self) -> Sample:
        """The next sample: in order, or a seeded draw from the full shuffle buffer (refilled from the stream)."""
        if not self.buffer_size:
            return self.in_order()
        while len(self.buffer) < self.buffer_size:
            self.buffer.append(self.in_order())
        slot = int(uniform(self.seed, SHUFFLE_STREAM, self.number, self.draws) * len(self.buffer))
        self.draws += 1
        sample, self.buffer[slot] = self.buffer[slot], self.in_order()
        return sample


class TrainStream:
    """The training stream of a ``data.streaming`` run: sources mixed by weight, optionally packed, cut into
    steps and this rank's micro-batches. A checkpoint object: :meth:`state_dict` is the whole data cursor."""

    def __init__(self, sources: list[SourceStream], weights: list[float], *, seed: int, packing: bool,
                 max_len: int, vocab: int | None = None) -> None:
        self.sources, self.seed, self.packing, self.max_len = sources, seed, packing, max_len
        self.vocab = vocab  # the tokenizer's size: a restored sample's token ids lie below it
        total = sum(weights)
        self.bounds = list(itertools.accumulate(w / total for w in weights))[:-1]  # source i: u < bounds[i]
        self.choices, self.carry = 0, None

    def state_dict(self) -> dict[str, Any]:
        return {"sources": [s.state_dict() for s in self.sources], "choices": self.choices, "carry": self.carry}

    def restored_problems(self, held: Any, counters: dict[str, Any]) -> list[str]:
        """What is wrong with the cursor a checkpoint holds (``held``; None: none, a checkpoint of a run that did
        not stream), asked before anything loads (finetune.storage.restored.check_objects): its counters must be
        whole numbers >= 0, each source's pending samples the shape tokenizing makes (token ids below the
        tokenizer's size, labels a token id or the ignore index), one state per source. A forged cursor (a re-hashed
        manifest) used to fail at the first resumed step, inside the model, after the metrics rows past the
        checkpoint were dropped."""
        if held is None:
            return ["is missing: this run streams its data, and its cursor is what a resume continues from"]
        if not isinstance(held, dict) or set(held) != {"sources", "choices", "carry"}:
            return ["is not a data stream's cursor (sources, choices, carry)"]
        found = _counts(held, ("choices",), "")
        if held["carry"] is not None:
            found += _sample_problems(held["carry"], "the carried sample", self.vocab)
        sources = held["sources"]
        if not isinstance(sources, list) or len(sources) != len(self.sources):
            return [*found, f"holds {len(sources) if isinstance(sources, list) else 'no'} source states for the "
                            f"{len(self.sources)} sources of data.train"]
        for i, source in enumerate(sources):
            where = f"source {i}"
            if not isinstance(source, dict) or set(source) != {"position", "passes", "rows", "kept", "queue",
                                                                "buffer", "draws"}:
                found.append(f"{where} is not a source's cursor")
                continue
            found += _counts(source, ("passes", "rows", "kept", "draws"), f"{where}: ")
            if not isinstance(source["position"], dict):
                found.append(f"{where}: its position is not a reader's position")
            for part in ("queue", "buffer"):
                samples = source[part] if isinstance(source[part], list) else [None]
                found += [problem for k, sample in enumerate(samples)
                          for problem in _sample_problems(sample, f"{where}: {part}[{k}]", self.vocab)]
        return found[:3]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["sources"]) != len(self.sources):
            raise DataError(f"the checkpoint's data stream has {len(state['sources'])} sources, data.train "
                            f"{len(self.sources)}")
        for source, own in zip(self.sources, state["sources"], strict=True):
            source.load_state_dict(own)
        self.choices, self.carry = int(state["choices"]), state["carry"]

    def sample(self) -> Sample:
        """The next sample of the mixture."""
        if len(self.sources) == 1:
            return self.sources[0].next()
        chosen = bisect.bisect_right(self.bounds, uniform(self.seed, MIX_STREAM, 0, self.choices))
        self.choices += 1
        return self.sources[chosen].next()

    def unit(self) -> list[Sample]:
        """One unit of the global batch: a sample, or with packing a row of samples of at most max_seq_len
        tokens (greedy: the sample that does not fit is carried into the next row)."""
        if not self.packing:
            return [self.sample()]
        row, tokens = [], 0
        while True:
            if self.carry is None:
                self.carry = self.sample()
            size = len(self.carry["input_ids"])
            if row and tokens + size > self.max_len:
                return row
            row.append(self.carry)
            tokens, self.carry = tokens + size, None

    def batches(self, *, rank: int, world: int, micro: int, global_batch: int,
                collate: Callable[[list[Sample]], dict[str, Any]], ahead: bool = False) -> Iterator[dict[str, Any]]:
        """This rank's micro-batches, step after step, forever: each step takes the next ``global_batch`` units,
        split into equal contiguous shares per rank, then into micro-batches of ``micro`` units.

        ``ahead``: one DataLoader worker process (a fork of this one, from its cursor) runs the same pipeline and
        hands on each chunk it reads and tokenizes, in the order this process will ask for them; this process
        runs shuffling, mixing, packing and collating on them. Only new samples cross the process boundary, and
        :meth:`state_dict` is this process's own state: the steps taken, never the worker's read-ahead.
        """
        if ahead:
            feed = iter(_worker_loader(self))

            def next_chunk(number: int) -> Chunk:
                source, chunk, error = next(feed)
                if error is not None:  # a bad row, as one line (a worker's exception would bring its traceback)
                    raise DataError(error)
                assert source == number, "the worker runs this process's pipeline from the same cursor"
                return chunk

            for source in self.sources:
                source.feed = next_chunk
        try:
            yield from self._steps(rank=rank, world=world, micro=micro, global_batch=global_batch, collate=collate)
        finally:
            for source in self.sources:
                source.feed = None

    def _steps(self, *, rank: int, world: int, micro: int, global_batch: int,
               collate: Callable[[list[Sample]], dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """This rank's micro-batches, forever (the units of a whole step are drawn before its first batch)."""
        share = global_batch // world
        while True:
            units = [self.unit() for _ in range(global_batch)]
            mine = units[rank * share:(rank + 1) * share]
            for i in range(0, share, micro):
                yield collate([sample for unit in mine[i:i + micro] for sample in unit])

    def peek(self) -> list[Sample]:
        """The first source's first samples in file order, without moving the cursor. Every other source's first
        chunk is read and tokenized too, so a source that cannot be opened or read (a hub dataset offline, a bad
        first row) fails before training, not at its first draw."""
        state = self.state_dict()
        try:
            for source in self.sources:
                source.restart()
            for source in self.sources[1:]:
                source.in_order()
            return [self.sources[0].in_order() for _ in range(PEEK)]
        finally:
            self.load_state_dict(state)


def _worker_loader(stream: TrainStream) -> Any:
    """A DataLoader whose one worker process runs ``stream``'s pipeline (forked from this process, so from its
    cursor) and yields each chunk as it is read and tokenized: (source number, chunk, None), or (None, None, the
    error line) for a DataError, after which it stops."""
    import torch  # heavy
    from torch.utils.data import DataLoader, IterableDataset  # imports torch

    class Ahead(IterableDataset):
        def __iter__(self) -> Iterator[tuple[int | None, Chunk | None, str | None]]:
            chunks: deque[tuple[int, Chunk]] = deque()
            for source in stream.sources:
                source.record = lambda chunk, number=source.number: chunks.append((number, chunk))
            try:
                while True:
                    stream.unit()
                    while chunks:
                        number, chunk = chunks.popleft()
                        yield number, chunk, None
            except DataError as exc:
                while chunks:  # those read before the bad row: this process may still need them
                    number, chunk = chunks.popleft()
                    yield number, chunk, None
                yield None, None, str(exc)

    # own generator: starting the worker must not draw from the global RNG (dropout stays exact on resume)
    return DataLoader(Ahead(), batch_size=None, num_workers=1, prefetch_factor=4, collate_fn=_as_is,
                      generator=torch.Generator())


def _as_is(item: Any) -> Any:
    """The worker's item unchanged (the default conversion would turn its tuples into lists)."""
    return item


def _whole(value: Any) -> bool:
    """Whether ``value`` is a whole number >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counts(state: dict[str, Any], keys: tuple[str, ...], where: str) -> list[str]:
    """A line for each of ``keys`` whose value in ``state`` is not a whole number >= 0."""
    return [f"{where}{key} is {state[key]!r}, not a count" for key in keys if not _whole(state[key])]


def _sample_problems(sample: Any, where: str, vocab: int | None) -> list[str]:
    """What is wrong with a restored sample: a mapping whose token lists (``*input_ids``, ``prompt_ids``) hold ids
    in [0, ``vocab``) and whose ``labels`` hold such ids or the ignore index, one per input id."""
    if not isinstance(sample, dict) or not isinstance(sample.get("input_ids"), list) or not sample["input_ids"]:
        return [f"{where} is not a tokenized sample"]
    below = vocab if vocab is not None else float("inf")
    for key, ids in sample.items():
        tokens = key.endswith("input_ids") or key == "prompt_ids"
        if tokens and (not isinstance(ids, list) or not all(_whole(t) and t < below for t in ids)):
            return [f"{where}: {key} holds a value that is not a token id (below {vocab})"]
    labels = sample.get("labels")
    if labels is not None and (not isinstance(labels, list) or len(labels) != len(sample["input_ids"])
                               or not all(t == IGNORE or (_whole(t) and t < below) for t in labels)):
        return [f"{where}: labels are not one token id (or the ignore index {IGNORE}) per input id"]
    return []


def open_stream(cfg: DataConfig, tokenizer: Any, *, seed: int, names: list[str], images: Any = None,
                labels: list[str] | None = None) -> TrainStream:
    """The training stream of ``cfg`` (``data.streaming``): no row is read yet, but every local file is checked
    (it exists, is a file, is not empty). ``names``: how messages name each source (finetune.data.source_name).
    A folder, a glob, a saved folder, a compressed file or a slice is refused in one line
    (:func:`finetune.data.local.unstreamable`): none has an exact resumable reader here yet."""
    for source, name in zip(cfg.train_sources(), names, strict=True):  # before any reader opens a file
        problem = local.unstreamable(source.path, source.split, name)
        if problem is not None:
            raise DataError(problem)
    sources = []
    for number, (source, name) in enumerate(zip(cfg.train_sources(), names, strict=True)):
        assert source.format is not None, "filled in by DataConfig.train_sources"
        fn, kwargs = row_function(source.format, cfg, tokenizer, images, labels)
        reader = JsonlRows(source.path) if Path(source.path).suffix == ".jsonl" else DatasetRows(source, name)

        checked = labels if source.format == "classification" else None

        def tokenize(rows: list[Row], fn: Any = fn, kwargs: Any = kwargs, name: str = name,
                     checked: list[str] | None = checked) -> list[Sample]:
            return tokenize_chunk(rows, fn, kwargs, source=name, overlong=cfg.overlong, labels=checked)

        sources.append(SourceStream(number, name, reader, tokenize, seed=seed,
                                    buffer=cfg.shuffle_buffer if cfg.shuffle else 0, max_len=cfg.max_seq_len))
    return TrainStream(sources, [s.weight for s in cfg.train_sources()], seed=seed, packing=cfg.packing,
                       max_len=cfg.max_seq_len, vocab=len(tokenizer))


def peek_split(stream: TrainStream) -> Tokenized:
    """The first samples as a tokenized split (probe inputs, ``finetune preprocess``); the stream is not moved."""
    from datasets import Dataset  # lazy: heavy

    return Tokenized(Dataset.from_list(stream.peek()), truncated=0, dropped=0, no_answer=0)
