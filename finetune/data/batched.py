"""Tokenize rows a batch at a time, in one or several processes: the functions ``tokenize_rows``' cached ``map``
runs, and how many processes run them.

Each row gets the work it always got, in file order: it is checked, rendered and its answer spans found, so
every check, mask and ``file:line`` error is the one the row would get alone. What is batched is the tokenizer:
one call per batch of texts to the Rust backend of a fast tokenizer (:func:`encode_texts`), which spreads the
batch over the cores and skips transformers' per-call setup (a call per row cost more than the tokenizing). The
labels of a sample come from its tokens' character offsets (:func:`answer_labels`), or, where the tokenizer's
offsets never go back (:func:`monotone`), from the run of tokens each answer span covers, found without reading
every token's offsets (:func:`_labels`). Each sample is tokenized once: its generation prompt's ids are its own
tokens up to a special-token match plus the few characters after it tokenized alone, where the tokenizer's rules
make that exactly the prompt's own tokenization (:func:`seams`, :func:`cue_ids`); else the prompt is tokenized
too. tests/unit/test_batched_equal.py holds both short cuts to a call per text on every format.

``data.num_proc`` worker processes (``datasets``' forked pool, each tokenizing a contiguous shard into its own
cache file) add the Python side (checks, chat templates) to the parallel part; :func:`processes` picks how many.
A bad row stops the pass with the same error whatever that number is: ``datasets`` waits for every shard and then
raises the first failed shard's error, and a shard stops at its first bad row, so the error is the first bad row
of the file (tests/unit/test_batched.py holds it to that).

:class:`Progress` reports a pass that really runs (a cache hit runs no row function) as plain lines; with several
processes its counters live in shared memory that forked workers inherit, so the lines stay one pass's lines. The
workers die with the process that forked them, whatever kills it (:func:`workers_die_with_this_process`).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import itertools
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from finetune import hooks
from finetune.data import prompts, shapes, vision
from finetune.data.bos import Lead
from finetune.data.formats import EVERY_TURN, ChatRule, Rendered, RowProblem, prerender_chats, render, render_preference
from finetune.data.loading import check_row
from finetune.data.rows import IGNORE, error_detail, line_of
from finetune.errors import DataError

if TYPE_CHECKING:
    from finetune.data.vision import ImageInputs

_R = TypeVar("_R")
BATCH_ROWS = 1000  # rows per call of a batch function (datasets' default)
MIN_ROWS_PER_PROCESS = 5000  # data.num_proc null: a worker costs a fork and a pickled tokenizer, worth it above this
MAX_DEFAULT_PROCESSES = 8  # data.num_proc null: at most this many (tokenizing stops scaling well, memory does not)


def processes(num_proc: int | None, rows: int) -> int:
    """How many processes tokenize ``rows`` rows: ``data.num_proc`` as set (at most one per row); null: the cores
    this process may use, at most :data:`MAX_DEFAULT_PROCESSES`, and one per :data:`MIN_ROWS_PER_PROCESS` rows (a
    small file is tokenized in the process itself)."""
    if num_proc is not None:
        return max(1, min(num_proc, rows))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_PROCESSES, rows // MIN_ROWS_PER_PROCESS))


# ------------------------------------------------------------------------------------------------ worker lifetime

PR_SET_PDEATHSIG = 1  # prctl(2): the signal the kernel sends this process when the thread that forked it ends
_FORKING: list[int] = []  # inside workers_die_with_this_process: the pid whose forks are tokenizing workers
_AT_FORK: list[bool] = []  # the fork hook is registered (once per process; os.register_at_fork has no undo)


def _die_with_parent(parent: int) -> None:
    """In a process just forked by ``parent``: be killed (SIGKILL) when ``parent`` dies, whatever kills it; exit
    now if it died before that was asked (the child of a dead parent is adopted by another process)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _forked() -> None:
    """Runs first in every forked child (os.register_at_fork); acts only in one forked inside
    :func:`workers_die_with_this_process` (a pool worker, or the manager process that carries their results)."""
    if not _FORKING:
        return
    parent = _FORKING[-1]
    _FORKING.clear()  # what this child forks itself is not the parent's worker
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C: the parent stops the pool and says one line
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool ends a worker with SIGTERM: not the parent's handler


def workers_running() -> bool:
    """Whether this process is inside :func:`workers_die_with_this_process` (its tokenizing workers may be running)."""
    return bool(_FORKING) and _FORKING[-1] == os.getpid()


@contextlib.contextmanager
def workers_die_with_this_process() -> Iterator[None]:
    """While inside, every process forked from this one (``datasets``' pool of ``data.num_proc`` workers, and
    the manager process it starts beside them) is killed by the kernel when this process dies, SIGKILL included
    (Linux's PR_SET_PDEATHSIG; elsewhere only the check that the parent is alive when the child starts), ignores
    Ctrl+C (this process stops the pool and says one line; a worker would print a traceback) and keeps SIGTERM's
    default action (the pool's terminate ends a worker; this process's own SIGTERM handler is not the worker's).
    Why: workers that outlived their killed parent went on tokenizing for nobody."""
    if not _AT_FORK:
        os.register_at_fork(after_in_child=_forked)
        _AT_FORK.append(True)
    _FORKING.append(os.getpid())
    try:
        yield
    finally:
        if _FORKING:  # a child that left the block (none of datasets' do) cleared it
            _FORKING.pop()


# ------------------------------------------------------------------------------------------------------ progress


class Progress:
    """Progress of one tokenization pass, as plain lines on stderr (``datasets``' bars are off).

    ``map`` calls the row functions only when its cache misses, so the first row tick is the moment real work
    starts: one line then says what is being tokenized, a line every ``every_s`` seconds gives the count and
    rate, and, if the pass was long enough to report progress, a last line gives its total time. A cache hit
    prints nothing. The row functions reach the active pass through the module-level :data:`ACTIVE`, because
    ``datasets`` hashes them (for the cache key) by name, so they cannot carry this object as an argument.
    ``shared``: the counters live in shared memory, so forked worker processes count into one pass.
    """

    def __init__(self, source: str, total: int, *, every_s: float = 30.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, shared: bool = False) -> None:
        self.source, self.total, self.every_s = source, total, every_s
        self._stream, self._clock = stream, clock
        # done, started, next report, reported (0/1): one array so that a fork shares all four
        self._state: Any = multiprocessing.RawArray("d", 4) if shared else [0.0] * 4
        self._lock: Any = multiprocessing.Lock() if shared else contextlib.nullcontext()

    @property
    def done(self) -> int:
        """Rows tokenized so far (by every process of the pass)."""
        return int(self._state[0])

    def tick(self) -> None:
        """One row tokenized."""
        now = self._clock()
        with self._lock:
            state = self._state
            first = state[0] == 0
            if first:
                state[1], state[2] = now, now + self.every_s
            state[0] += 1
            report = now >= state[2]
            if report:
                state[2], state[3] = now + self.every_s, 1.0
            done, started = int(state[0]), state[1]
        if first:
            self._say(f"tokenizing {self.source}: {self.total} rows (cached for later runs)")
            hooks.fire("tokenizing", source=self.source)  # a test seam: a real pass starts (never on a cache hit)
        if report:
            rate = done / max(now - started, 1e-9)
            self._say(f"tokenizing {self.source}: {done}/{self.total} rows ({100 * done / self.total:.0f}%), "
                      f"{rate:.0f} rows/s")

    def finish(self) -> None:
        """Say how long a pass that reported progress took."""
        if self._state[3]:
            self._say(f"tokenized {self.source}: {self.done} rows in {self._clock() - self._state[1]:.0f}s")

    def _say(self, text: str) -> None:
        print(text, file=self._stream or sys.stderr, flush=True)


ACTIVE: list[Progress] = []  # the pass in progress (at most one), see Progress


def _tick() -> None:
    if ACTIVE:
        ACTIVE[-1].tick()


# ------------------------------------------------------------------------------------------------- tokenizing


def _backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a fast ``tokenizer`` when calling it directly gives exactly what
    ``tokenizer(texts, add_special_tokens=False)`` gives: set to neither truncate nor pad (transformers would turn
    both off for such a call) and to split special tokens as transformers would; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


def encode_texts(texts: Sequence[str], tokenizer: Any) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Token ids and character offsets of each text, as ``tokenizer(text, add_special_tokens=False,
    return_offsets_mapping=True)`` gives them, in one call for the whole batch."""
    if not texts:
        return []
    backend = _backend(tokenizer)
    if backend is not None:
        return [(enc.ids, enc.offsets) for enc in backend.encode_batch(list(texts), add_special_tokens=False)]
    enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    return list(zip(enc["input_ids"], enc["offset_mapping"], strict=True))


def token_ids(texts: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Token ids of each text, as ``tokenizer(text, add_special_tokens=False)["input_ids"]``, in one call."""
    if not texts:
        return []
    backend = _backend(tokenizer)
    if backend is not None:
        return [enc.ids for enc in backend.encode_batch_fast(list(texts), add_special_tokens=False)]
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def answer_labels(ids: list[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
                  ) -> list[int]:
    """The label of each token: its id where the token's characters overlap an answer span, else IGNORE (one
    comparison per token for the common single span: a generator per token cost more than tokenizing)."""
    if len(spans) == 1:
        [(first, last)] = spans
        return [tid if start < last and end > first else IGNORE for tid, (start, end) in zip(ids, offsets, strict=True)]
    return [tid if any(start < last and end > first for first, last in spans) else IGNORE
            for tid, (start, end) in zip(ids, offsets, strict=True)]


class _Listed:
    """Token ids and offsets as transformers gives them, read as a Rust ``Encoding`` is (``ids``, ``offsets``,
    ``token_to_chars``), so the functions below take either."""

    def __init__(self, ids: list[int], offsets: Sequence[tuple[int, int]]) -> None:
        self.ids, self.offsets = list(ids), [tuple(pair) for pair in offsets]

    def token_to_chars(self, index: int) -> tuple[int, int] | None:
        return self.offsets[index] if 0 <= index < len(self.offsets) else None


def encodings(texts: Sequence[str], tokenizer: Any) -> list[tuple[list[int], Any]]:
    """What :func:`encode_texts` gives, as (ids, encoding): the offsets left in the Rust ``Encoding`` of a fast
    tokenizer's one call for the batch, since reading all of a text's offsets into Python tuples cost more than its
    labels need (see :func:`_labels`). The ids lists are shared: never changed in place."""
    if not texts:
        return []
    backend = _backend(tokenizer)
    if backend is not None:
        return [(enc.ids, enc) for enc in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [(listed.ids, listed) for listed in (_Listed(*pair) for pair in encode_texts(texts, tokenizer))]


# Offsets that never go back (each token starts and ends at or after where the one before it starts and ends)
# make the tokens overlapping a span [first, last) one run: from the first token ending after ``first`` to the
# last starting before ``last``. Two binary searches find it, reading ~20 tokens' offsets instead of all. A fast
# tokenizer's tokens come out piece by piece in text order (added-token matches, then pre-tokens, then the model's
# tokens of each), and each token's offsets are its characters mapped back through the normalizer; only a
# normalizer that reorders characters (Unicode normalization puts combining marks in canonical order) can map a
# later token to earlier characters. ByteLevel's offset trimming moves a start forward only up to its own end,
# and an end back only down to its own start, both within the token's own characters. :func:`monotone` allows
# the runs where the normalizer is one of the order-keeping ones; else every token's offsets are compared
# (:func:`answer_labels`).
ORDER_KEEPING_NORMALIZERS = frozenset({"Sequence", "Prepend", "Replace", "Lowercase", "Strip", "StripAccents"})


def monotone(tokenizer: Any) -> bool:
    """Whether the offsets of ``tokenizer``'s tokens never go back (see the comment above): a Rust backend called
    as is, whose normalizer (if any) only keeps order and whose pre-tokenizer is serializable (not Python code)."""
    backend = _backend(tokenizer)
    if backend is None:
        return False
    try:
        for part in (backend.normalizer, backend.pre_tokenizer):
            if part is not None:
                json.loads(part.__getstate__())
        normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else {}
    except Exception:  # a custom (Python) component cannot be serialized: its rules are unknown
        return False
    return _types(normalizer) <= ORDER_KEEPING_NORMALIZERS


def _types(config: Any) -> set[str]:
    """Every component ``type`` named in a tokenizer component's JSON config."""
    if isinstance(config, dict):
        own = {config["type"]} if isinstance(config.get("type"), str) else set()
        return own.union(*(_types(value) for value in config.values()))
    if isinstance(config, list):
        return set().union(*(_types(value) for value in config))
    return set()


def _run_start(enc: Any, count: int, first: int) -> int:
    """The first token ending after character ``first`` (offsets that never go back): the token holding that
    character, found by the encoding's own lookup and confirmed by its neighbour's offsets, else by binary search."""
    k = enc.char_to_token(first) if hasattr(enc, "char_to_token") else None
    if k is not None and enc.token_to_chars(k)[1] > first and (k == 0 or enc.token_to_chars(k - 1)[1] <= first):
        return k
    return bisect.bisect_right(range(count), first, key=lambda i: enc.token_to_chars(i)[1])


def _run_stop(enc: Any, count: int, last: int) -> int:
    """The first token starting at or after character ``last`` (offsets that never go back): found as for
    :func:`_run_start` from the token holding that character, else by binary search."""
    k = enc.char_to_token(last) if hasattr(enc, "char_to_token") else None
    if k is not None:
        k = k if enc.token_to_chars(k)[0] >= last else k + 1
        if (k == 0 or enc.token_to_chars(k - 1)[0] < last) and (k == count or enc.token_to_chars(k)[0] >= last):
            return k
    return bisect.bisect_left(range(count), last, key=lambda i: enc.token_to_chars(i)[0])


def _labels(ids: list[int], enc: Any, spans: Sequence[tuple[int, int]], in_order: bool) -> list[int]:
    """:func:`answer_labels` of a text's tokens (``enc``: its encoding); ``in_order`` (:func:`monotone`): by the
    run of each span, found by binary search, the same labels without reading every token's offsets."""
    if not in_order:
        return answer_labels(ids, enc.offsets, spans)
    count = len(ids)
    try:
        runs = [(_run_start(enc, count, first), _run_stop(enc, count, last)) for first, last in spans]
    except TypeError:  # a token without offsets (None): compare them all
        return answer_labels(ids, enc.offsets, spans)
    if len(runs) == 1:
        [(start, stop)] = runs
        if start >= stop:
            return [IGNORE] * count
        return [IGNORE] * start + ids[start:stop] + [IGNORE] * (count - stop)
    labels = [IGNORE] * count
    for start, stop in runs:
        labels[start:stop] = ids[start:stop]
    return labels


def _samples(rendered: Sequence[Rendered], encoded: Sequence[tuple[list[int], Any]], tokenizer: Any,
             lead: Lead) -> list[tuple[list[int], list[int]]]:
    """:func:`samples` of texts already encoded (``encoded``: :func:`encodings` of their texts)."""
    out = []
    eos = lead.eos_token_id
    in_order = monotone(tokenizer)
    for sample, (ids, enc) in zip(rendered, encoded, strict=True):
        labels = _labels(ids, enc, sample.spans, in_order)  # a new list
        head = lead.ids(sample.text, sample.templated)
        if head:
            ids, labels = [*head, *ids], [IGNORE] * len(head) + labels
        if sample.add_eos and eos is not None:
            ids = [*ids, eos]  # ids may be the encoding's list, shared with the prompt's
            labels.append(eos)
        out.append((ids, labels))
    return out


def samples(rendered: Sequence[Rendered], tokenizer: Any, add_bos: str) -> list[tuple[list[int], list[int]]]:
    """Token ids and labels of each rendered sample: labels by :func:`answer_labels`; the special tokens before
    them by ``data.add_bos`` (:class:`finetune.data.bos.Lead`), eos last (and learned) where the format adds it."""
    return _samples(rendered, encodings([r.text for r in rendered], tokenizer), tokenizer, Lead.of(tokenizer, add_bos))


def _cue(ids: list[int], text: str, templated: bool, lead: Lead, max_len: int) -> list[int]:
    """A prompt's ids (no special tokens added) as :func:`finetune.data.prompts.text_prompt` makes them."""
    return prompts.keep_end(lead.encode(text, ids, templated), max_len).ids


# The prompt of a causal sample is the start of its text (``text[:p]``, p = len(prompt)): chat's generation prompt,
# alpaca's instruction. Tokenizing it again costs a second tokenizer pass over most of the row. A fast tokenizer
# cuts a text at each match of an added token (special tokens: ``<|assistant|>``, ``<|im_start|>``) before anything
# else, and tokenizes the pieces between matches each on its own. So where the sample's tokens hold a match T
# that ends at q <= p, the prompt's tokens are the sample's tokens up to T and the tokens of ``text[q:p]`` alone
# (usually a "\n" or "assistant\n", the same in every row): the added tokens are found in ``text[:p]``
# leftmost-longest as in the whole text, so the matches up to q are the same ones (a match ending after q would
# have to start before q, inside a match or overlapping a longer one); the pieces up to T are the same strings at
# the same places; and a piece after T is the same string either way. That holds when the rules of the tokenizer
# depend on nothing but a piece's own text: :func:`seams` says when (else every prompt is tokenized).
SEAM_WINDOW = 16  # tokens searched back from the prompt's end for a match to cut after (a chat prompt needs 1-3)


def seams(tokenizer: Any) -> dict[int, str]:
    """The added tokens a prompt's tokens may be cut after (id -> text; see the comment above), or none when the
    tokenizer's rules do not allow it: no Rust backend to call as is; special tokens not matched
    (``split_special_tokens``); an added token matched in the raw text that strips spaces around it or matches whole
    words only (its match is not its text); a pre-tokenizer that treats a text's first piece differently
    (Metaspace ``prepend_scheme: first``) or is Python code; a BPE with dropout (not the same tokens twice)."""
    backend = _backend(tokenizer)
    if backend is None or backend.encode_special_tokens:
        return {}
    try:
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else None
    except Exception:  # a custom (Python) pre-tokenizer cannot be serialized: its rules are unknown
        return {}
    if _first_piece_rule(pre) or getattr(backend.model, "dropout", None):
        return {}
    raw = {tid: token for tid, token in backend.get_added_tokens_decoder().items() if not token.normalized}
    if any(token.lstrip or token.rstrip or token.single_word for token in raw.values()):
        return {}
    return {tid: token.content for tid, token in raw.items() if token.content}


def _first_piece_rule(config: Any) -> bool:
    """Whether a pre-tokenizer's JSON config holds a step that treats the start of the text apart."""
    if isinstance(config, dict):
        if config.get("type") == "Metaspace" and config.get("prepend_scheme", "always") == "first":
            return True
        return any(_first_piece_rule(value) for value in config.values())
    if isinstance(config, list):
        return any(_first_piece_rule(value) for value in config)
    return False


def _seam(text: str, prompt_len: int, ids: list[int], enc: Any, cut: dict[int, str]) -> tuple[int, int] | None:
    """(index, end) of a token of ``text`` (``enc``: its encoding) that is a match of an added token in ``cut``
    ending at or before ``prompt_len`` (the last such within :data:`SEAM_WINDOW` tokens of where the prompt's end
    is found; where offsets go back that search may miss one, never take a wrong one), or None."""
    try:  # the first token starting at or after the prompt's end, where offsets never go back
        end = _run_stop(enc, len(ids), prompt_len)
    except TypeError:  # a token without offsets
        return None
    for index in range(end - 1, max(end - SEAM_WINDOW, 0) - 1, -1):
        content = cut.get(ids[index])
        if content is not None:
            start, stop = enc.token_to_chars(index)
            if stop <= prompt_len and text[start:stop] == content:
                return index, stop
    return None


def cue_ids(rendered: Sequence[Rendered], encoded: Sequence[tuple[list[int], Any]], tokenizer: Any, max_len: int,
            lead: Lead) -> list[list[int]]:
    """The generation prompt (:func:`finetune.data.prompts.text_prompt`) of each sample's prompt, from the sample's
    own tokens (``encoded``) where its prompt starts its text and they hold a seam (see :func:`seams`): only the text
    after the seam is tokenized, once per distinct text. Every other prompt is tokenized whole, as that function
    does."""
    cut = seams(tokenizer)
    heads: list[list[int]] = []
    tails: list[str] = []
    for sample, (ids, enc) in zip(rendered, encoded, strict=True):
        prompt = sample.prompt
        found = None
        if cut and prompt and sample.text.startswith(prompt):
            found = _seam(sample.text, len(prompt), ids, enc, cut)
        if found is None:
            heads.append([])
            tails.append(prompt)
        else:
            index, stop = found
            heads.append(ids[:index + 1])
            tails.append(prompt[stop:])
    distinct = list(dict.fromkeys(tails))
    tail_ids = dict(zip(distinct, token_ids(distinct, tokenizer), strict=True))
    return [_cue(head + tail_ids[tail], sample.prompt, sample.templated, lead, max_len)
            for sample, head, tail in zip(rendered, heads, tails, strict=True)]


def rendered(render_row: Callable[[], _R], where: str, what: str) -> _R:
    """``render_row()``; anything but a DataError it raises (e.g. a chat template's ``raise_exception("roles must
    alternate ...")``) becomes one DataError line, ``where: what (detail)`` (a RowProblem: ``where: problem``)."""
    try:
        return render_row()
    except DataError:
        raise
    except RowProblem as exc:  # its own sentence
        raise DataError(f"{where}: {exc}") from None
    except Exception as exc:
        raise DataError(f"{where}: {what} ({error_detail(exc)})") from None


# ----------------------------------------------------------------------------------------------- batch functions


def _rows(batch: Any, indices: list[int]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, row) of each row of a batch, in order (each one a progress tick)."""
    columns = {name: batch[name] for name in batch}
    for index, values in zip(indices, zip(*columns.values(), strict=True), strict=True):
        _tick()
        yield index, dict(zip(columns, values, strict=True))


def _count(labels: list[int]) -> int:
    return len(labels) - labels.count(IGNORE)


# The arrow types finetune.data.tokenize.output_features gives the token columns. A batch function returns its
# columns as an arrow table of these types: ``datasets`` would otherwise infer int64 from the Python lists and cast
# (input_ids to int32), twice the work of building them typed. The writer still casts every batch to the map's
# features, so a type that differed here would cost a cast, never change what is stored.
INT32_LISTS = frozenset({"input_ids", "chosen_input_ids", "rejected_input_ids"})


def _table(columns: dict[str, list]) -> Any:
    """``columns`` as an arrow table: lists of token ids typed as the output features type them (int32 ids, int64
    labels and prompts), other columns as arrow infers them; a batch of no rows stays Python lists."""
    import pyarrow as pa  # lazy: heavy (the CLI imports no pyarrow)

    if not any(columns.values()):
        return columns
    arrays = [pa.array(values, type=pa.list_(pa.int32() if name in INT32_LISTS else pa.int64()))
              if isinstance(values[0], list) else pa.array(values) for name, values in columns.items()]
    return pa.Table.from_arrays(arrays, names=list(columns))


CAUSAL_COLUMNS = ("input_ids", "labels", "prompt_ids", "reference", "calls", "overlong", "n_labels")


def causal_batch(batch: Any, indices: list[int], *, fmt: str, tokenizer: Any, max_len: int, train_on_prompt: bool,
                 add_bos: str, source: str, reading: shapes.Reading = (), rule: ChatRule = EVERY_TURN,
                 code_version: str = "") -> dict[str, list]:
    """Alpaca, completion and chat rows: read as the format's own fields (``reading``: the shapes of
    :mod:`finetune.data.shapes`, e.g. ShareGPT chat rows), checked, rendered (``train_on_prompt``: the whole text is
    the answer), tokenized, cut to ``max_len`` (training keeps the start; a generation prompt keeps its end, the
    cue): the columns of :func:`causal_table` as Python lists (what a stream's reader takes)."""
    table = causal_table(batch, indices, fmt=fmt, tokenizer=tokenizer, max_len=max_len,
                         train_on_prompt=train_on_prompt, add_bos=add_bos, source=source, reading=reading, rule=rule)
    return table if isinstance(table, dict) else table.to_pydict()


def causal_table(batch: Any, indices: list[int], *, fmt: str, tokenizer: Any, max_len: int, train_on_prompt: bool,
                 add_bos: str, source: str, reading: shapes.Reading = (), rule: ChatRule = EVERY_TURN,
                 code_version: str = "") -> Any:
    """:func:`causal_batch`'s columns as the arrow table ``tokenize_rows``' map writes, typed as the output features
    type them (int32 ids, int64 labels and prompts: ``datasets`` would otherwise infer int64 and cast). The token
    columns are built in one pass each (:func:`_token_arrays`), never as a Python list per sample's labels; a batch
    of no rows is Python lists. ``code_version`` is unused here: it is part of the map cache key (see
    :mod:`finetune.data.tokenize`), as ``reading`` is besides choosing the shapes."""
    import pyarrow as pa  # lazy: heavy (the CLI imports no pyarrow)

    what = "the tokenizer's chat template rejects this conversation" if fmt == "chat" else "cannot render this row"
    batch = shapes.normalize_batch(batch, indices, reading, source)  # e.g. ShareGPT conversations -> messages
    outs: list[Rendered] = []
    # chat: every row's template renders in two batched calls (None: a row is bad, so rendered row by row below)
    # (rows with tools are rendered each with its own: a batched call takes one tools list for all)
    tooled = "tools" in batch and any(tools is not None for tools in batch["tools"])
    chats = prerender_chats(list(batch["messages"]), tokenizer, rule) if fmt == "chat" and "messages" in batch \
        and not tooled else None
    for k, (index, row) in enumerate(_rows(batch, indices)):
        check_row(row, index, fmt, source)  # inside the cached map: checked once per data/code version
        texts = chats[k] if chats is not None else None
        # a chat row may give several samples (formats.render_chat: one per group of its assistant turns)
        outs.extend(rendered(partial(render, row, fmt, tokenizer, train_on_prompt, texts, rule),
                             line_of(source, index), what))
    if not outs:
        return {name: [] for name in CAUSAL_COLUMNS}
    lead = Lead.of(tokenizer, add_bos)
    encoded = encodings([out.text for out in outs], tokenizer)
    cues = cue_ids(outs, encoded, tokenizer, max_len, lead)  # out.prompt of chat: prompts.chat_text
    ids, labels, overlong, n_labels = _token_arrays(outs, encoded, tokenizer, lead, max_len)
    arrays = [ids, labels, pa.array(cues, type=pa.list_(pa.int64())),
              pa.array([out.reference for out in outs], type=pa.string()),
              pa.array([out.calls for out in outs], type=pa.string()), pa.array(overlong), pa.array(n_labels)]
    return pa.Table.from_arrays(arrays, names=list(CAUSAL_COLUMNS))


def _token_arrays(rendered: Sequence[Rendered], encoded: Sequence[tuple[list[int], Any]], tokenizer: Any,
                  lead: Lead, max_len: int) -> tuple[Any, Any, Any, Any]:
    """:func:`_samples` of each sample cut to ``max_len``, as arrow list arrays (int32 ids, int64 labels), with
    each sample's over-long flag and its count of answer tokens (numpy). The same ids and labels: the special
    tokens of ``lead`` first, eos last (and learned) where the format adds it, labels the ids of the tokens each
    answer span
    covers (:func:`_runs`). All ids are read into one array once; the labels are that array with IGNORE outside
    the runs, so no sample's labels are a Python list (they cost as much as the arrow writing)."""
    import numpy as np  # lazy: heavy (the CLI imports no numpy)
    import pyarrow as pa  # lazy: heavy (the CLI imports no pyarrow)

    eos = lead.eos_token_id
    in_order = monotone(tokenizer)
    pieces: list[Sequence[int]] = []
    lengths: list[int] = []
    marks = []  # per sample: (special tokens first, eos last, the runs of answer tokens or every label)
    for sample, (ids, enc) in zip(rendered, encoded, strict=True):
        first = lead.ids(sample.text, sample.templated)
        head = len(first)
        tail = bool(sample.add_eos and eos is not None)
        pieces += [first, ids] if head else [ids]
        if tail:
            pieces.append((eos,))
        lengths.append(head + len(ids) + tail)
        marks.append((head, tail, _runs(ids, enc, sample.spans, in_order)))
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = ends - lengths
    flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=int(ends[-1]) if len(ends) else 0)
    labels = np.full(len(flat), IGNORE, dtype=np.int64)
    for (head, tail, runs), begin, end in zip(marks, starts.tolist(), ends.tolist(), strict=True):
        begin += head
        if isinstance(runs, list):
            labels[begin:begin + len(runs)] = runs  # every label, compared token by token
        else:
            for first, stop in runs:
                labels[begin + first:begin + stop] = flat[begin + first:begin + stop]
        if tail:
            labels[end - 1] = eos
    overlong = np.asarray(lengths, dtype=np.int64) > max_len
    if overlong.any():  # training keeps each over-long sample's start
        keep = np.ones(len(flat), dtype=bool)
        for begin, end in zip(starts[overlong].tolist(), ends[overlong].tolist(), strict=True):
            keep[begin + max_len:end] = False
        flat, labels = flat[keep], labels[keep]
        ends = np.cumsum(np.minimum(lengths, max_len), dtype=np.int64)
    offsets = np.concatenate([[0], ends]).astype(np.int32)
    answered = np.concatenate([[0], np.cumsum(labels != IGNORE)])
    n_labels = answered[offsets[1:]] - answered[offsets[:-1]]
    ids_array = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(np.int32)))
    labels_array = pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels))
    return ids_array, labels_array, overlong, n_labels


def _runs(ids: list[int], enc: Any, spans: Sequence[tuple[int, int]], in_order: bool
          ) -> tuple[tuple[int, int], ...] | list[int]:
    """The answer tokens of a text (``enc``: its encoding) as :func:`_labels` finds them: with ``in_order``, the
    (start, stop) run of tokens of each span; else (or for a token without offsets) every token's label."""
    if not in_order:
        return answer_labels(ids, enc.offsets, spans)
    count = len(ids)
    try:
        return tuple((_run_start(enc, count, first), _run_stop(enc, count, last)) for first, last in spans)
    except TypeError:  # a token without offsets (None): compare them all
        return answer_labels(ids, enc.offsets, spans)


def preference_batch(batch: Any, indices: list[int], *, tokenizer: Any, max_len: int, add_bos: str, source: str,
                     code_version: str = "") -> dict[str, list]:
    """Preference pairs as the columns of the data contract: ``chosen_input_ids``, ``chosen_labels``,
    ``rejected_input_ids``, ``rejected_labels`` (labels: the ids of answer tokens, IGNORE on the prompt). Each
    sequence keeps its start when cut to ``max_len``, so the prompt stays whole where it fits; ``n_labels`` is the
    smaller answer count of the two, so a pair with no answer token left on either side is skipped, and so is a
    pair whose two sides are the same tokens once cut (its loss is ln 2 whatever the model: nothing to learn)."""
    pairs: list[Rendered] = []
    for index, row in _rows(batch, indices):
        check_row(row, index, "preference", source)
        pairs.extend(rendered(partial(render_preference, row, tokenizer), line_of(source, index),
                              "the tokenizer's chat template rejects this pair"))
    columns: dict[str, list] = {name: [] for name in ("chosen_input_ids", "chosen_labels", "rejected_input_ids",
                                                      "rejected_labels", "overlong", "n_labels")}
    encoded = samples(pairs, tokenizer, add_bos)
    for (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) in zip(encoded[::2], encoded[1::2],
                                                                            strict=True):
        columns["overlong"].append(len(chosen_ids) > max_len or len(rejected_ids) > max_len)
        cut = [chosen_ids[:max_len], chosen_labels[:max_len], rejected_ids[:max_len], rejected_labels[:max_len]]
        for name, value in zip(("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"), cut,
                               strict=True):
            columns[name].append(value)
        same = cut[0] == cut[2] and cut[1] == cut[3]
        # answer tokens are next-token targets: a label at the first position is never one
        columns["n_labels"].append(0 if same else min(_count(cut[1][1:]), _count(cut[3][1:])))
    return columns


def preference_table(batch: Any, indices: list[int], **kwargs: Any) -> Any:
    """:func:`preference_batch` as an arrow table (:func:`_table`): what ``tokenize_rows``' map writes."""
    return _table(preference_batch(batch, indices, **kwargs))


def _vision_row(row: dict[str, Any], index: int, *, tokenizer: Any, images: ImageInputs, max_len: int,
                train_on_prompt: bool, add_bos: str, source: str) -> dict[str, Any]:
    """A vision_chat row: rendered as a chat row, each image placeholder repeated once per image feature, image
    tokens never trained on, cut (when over-long) only between images; ``images`` (absolute paths) and
    ``image_grids`` record every image of the prompt, ``n_images`` how many the (cut) inputs hold."""
    check_row(row, index, "vision_chat", source)
    where = line_of(source, index)
    messages = row["messages"]
    paths = [vision.resolve(ref, source) for ref in vision.image_refs(row)]
    grids = images.grids([vision.open_image(path, where) for path in paths], where, paths)
    counts = [images.tokens(grid) for grid in grids]
    conversation = vision.for_template(messages)
    outs = rendered(partial(render, {"messages": conversation}, "chat", tokenizer, train_on_prompt), where,
                    "the tokenizer's chat template rejects this conversation")
    if len(outs) > 1:
        raise DataError(f"{where}: the chat template renders this conversation's last assistant turn differently "
                        "from its earlier ones, which vision_chat rows do not train yet; give one assistant turn per "
                        "row, or set data.train_on_prompt")
    [out] = outs
    vision.check_placeholders(out.text, images.image_token, len(paths), where)
    out = vision.expand(dataclasses.replace(out, reference=vision.text_of(messages[-1]["content"])),
                        images.image_token, counts)
    [(ids, labels)] = samples([out], tokenizer, add_bos)
    labels = [IGNORE if tid == images.image_token_id else label for tid, label in zip(ids, labels, strict=True)]
    cut, kept = vision.fit(ids, images.image_token_id, counts, max_len)
    # as generate renders it; a prompt whose kept end would leave out an image stays whole (cuts_image)
    prompt = prompts.vision_prompt(prompts.vision_text(messages[:-1], tokenizer), tokenizer, images, grids, where,
                                   max_len, Lead.of(tokenizer, add_bos), templated=True)
    return {"input_ids": ids[:cut], "labels": labels[:cut], "prompt_ids": prompt.ids, "reference": out.reference,
            "calls": None,
            "images": [str(path) for path in paths], "image_grids": grids, "n_images": kept,
            "overlong": len(ids) > max_len, "n_labels": _count(labels[:cut])}


def _classification_row(row: dict[str, Any], index: int, *, tokenizer: Any, max_len: int,
                        label_ids: dict[str, int], source: str) -> dict[str, Any]:
    check_row(row, index, "classification", source)
    full = tokenizer(row["text"], truncation=False)["input_ids"]
    overlong = len(full) > max_len
    ids = tokenizer(row["text"], truncation=True, max_length=max_len)["input_ids"] if overlong else full
    return {"input_ids": ids, "label": label_ids[str(row["label"])], "overlong": overlong, "n_labels": 1}


def _each_row(row_fn: Callable[..., dict[str, Any]], batch: Any, indices: list[int], **kwargs: Any
              ) -> dict[str, list]:
    """A batch of rows that each need their own work (images, or a tokenizer call with truncation), as columns."""
    columns: dict[str, list] = {}
    for index, row in _rows(batch, indices):
        for name, value in row_fn(row, index, **kwargs).items():
            columns.setdefault(name, []).append(value)
    return columns


def vision_batch(batch: Any, indices: list[int], *, tokenizer: Any, images: ImageInputs, max_len: int,
                 train_on_prompt: bool, add_bos: str, source: str, code_version: str = "") -> dict[str, list]:
    """vision_chat rows, one by one (:func:`_vision_row`: the images make each row its own work)."""
    return _each_row(_vision_row, batch, indices, tokenizer=tokenizer, images=images, max_len=max_len,
                     train_on_prompt=train_on_prompt, add_bos=add_bos, source=source)


def classification_batch(batch: Any, indices: list[int], *, tokenizer: Any, max_len: int,
                         label_ids: dict[str, int], source: str, code_version: str = "") -> dict[str, list]:
    """Classification rows: the text with the tokenizer's special tokens, cut to ``max_len`` by the tokenizer's
    own truncation; ``label`` the class id."""
    return _each_row(_classification_row, batch, indices, tokenizer=tokenizer, max_len=max_len,
                     label_ids=label_ids, source=source)
