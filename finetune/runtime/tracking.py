"""Metric sinks for the training loop.

Every sink implements the one :class:`Tracker` protocol, ``log(kind, row)`` and ``close()``, where ``kind`` is
``"train"``, ``"eval"`` or ``"info"`` (see :data:`KINDS` for what each row holds). Each sink is a small class that
does one thing; :class:`MultiTracker` fans out to several and :class:`NullTracker` stands in wherever nothing should
happen (non-zero ranks), so the loop never branches on "is this sink on?".

On rank 0 :func:`build_tracker` always writes ``metrics.jsonl`` (machine-readable, read back by
:func:`read_metrics`) and ``train.log`` (human-readable), shows progress on stdout (:class:`ProgressTracker`: a rich
bar on a terminal, else one line per row), and adds Weights & Biases and TensorBoard when the recipe enables them.
wandb and tensorboard (which imports torch) are imported only when enabled, so importing this module stays cheap
for the CLI.

Tokens per second (and the FLOPs per token, MFU) are computed once per train row, by the loop's
:class:`Throughput`, and travel in the row as ``tokens_per_s`` etc.; every sink that shows them reads them from there.

What a run's step lines lead with is its Headline (finetune.storage.metrics, with the reader of metrics.jsonl).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import string
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

from finetune.config.schema import RecipeConfig
from finetune.errors import ConfigError
from finetune.storage import rundir
from finetune.storage.metrics import LOSS_FIRST, Row, cfg_headline, format_metrics

if TYPE_CHECKING:
    from finetune.runtime.meter import StepFlops

KINDS: tuple[str, ...] = ("train", "eval", "info", "end")
"""The kinds of row a tracker is given:

- ``train``: step, loss, lr, grad_norm, tokens (cumulative target tokens), elapsed_s (cumulative), and since the
  previous train row of this process, per device: tokens_per_s (input tokens, padding left out) and
  target_tokens_per_s, flops_per_token and mfu (when the model's FLOPs, and for mfu the device's peak, are known);
  mem_alloc_gb / mem_reserved_gb (this device's peaks, CUDA only); and optionally loss_scale, skipped, nonfinite,
  and aux_loss (a mixture-of-experts model's router load-balancing loss, part of loss: finetune.tasks.router);
- ``eval``: step, eval_loss, eval_ppl, eval_samples, eval_<metric> with eval_<metric>_correct / _total, and
  eval_correct / eval_total (the first metric's counts);
- ``info``: an event, ``{"message": "saved checkpoint step-000100"}``; ``"level": "warning"`` marks one the user
  must see (the console sends it to stderr when it is not drawing a bar); ``"console": False`` one for the logs
  only (the command prints it itself, e.g. the stop message that ends the process);
- ``end``: the run's last row in metrics.jsonl, written once it has finished (see :mod:`finetune.storage.summary`):
  step, samples, tokens, train_s (training time, over every process of the run) and wall_s (this process, from its start
  to the end); a finished run is one whose metrics.jsonl ends with it.
"""

class Tracker(Protocol):
    """Where the training loop sends metrics and events."""

    def log(self, kind: str, row: Row) -> None:
        """One row of ``kind`` (one of :data:`KINDS`)."""

    def close(self) -> None:
        """Flush and release whatever the sink holds; called once at the end of the run."""


class NullTracker:
    """A sink that does nothing: what non-zero ranks get."""

    def log(self, kind: str, row: Row) -> None:
        """Ignore the row."""

    def close(self) -> None:
        """Nothing to release."""


class MultiTracker:
    """Fans every row out to several trackers, in order; close() closes all of them even if one raises."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers: list[Tracker] = list(trackers)

    def log(self, kind: str, row: Row) -> None:
        """Send the row to every tracker; an unknown kind is a programming error (ValueError), caught here once."""
        if kind not in KINDS:
            raise ValueError(f"unknown row kind {kind!r}; expected one of {', '.join(KINDS)}")
        for tracker in self.trackers:
            tracker.log(kind, row)

    def close(self) -> None:
        """Close every tracker, then re-raise the first error (a failing sink must not leak the others)."""
        first_error: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # collected, re-raised after the others are closed
                first_error = first_error or exc
        if first_error is not None:
            raise first_error


class _LineFile:
    """An append-only text file written one flushed line at a time, so a crash loses at most the line in flight.

    Appending (not truncating) keeps the earlier part of a resumed run in the same file.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = rundir.open_append(path)  # never through a link, into a FIFO or someone else's file

    def write(self, line: str) -> None:
        """Append one line (the newline is added here) and flush it to the OS."""
        self._fh.write(line + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._fh.close()


class JsonlTracker:
    """Appends one JSON object per train or eval row to ``<run_dir>/metrics.jsonl``, tagged with its ``kind``.

    This is the machine-readable record of a run (tests and the CLI read it with :func:`read_metrics`); info rows
    are not metrics and go to train.log only. Non-finite floats are written as ``NaN`` / ``Infinity``, which
    Python's json reads back.
    """

    def __init__(self, run_dir: Path) -> None:
        self._file = _LineFile(Path(run_dir) / rundir.METRICS)

    def log(self, kind: str, row: Row) -> None:
        """Append a train or eval row with its ``kind``; info rows are not written."""
        if kind == "info":
            return
        record = {"kind": kind, **{key: value for key, value in row.items() if key != "kind"}}
        self._file.write(json.dumps(record))

    def close(self) -> None:
        """Close metrics.jsonl."""
        self._file.close()


class Throughput:
    """Rates between successive train rows: target tokens from cumulative ``tokens`` and ``elapsed_s``, input
    tokens and FLOPs from the steps :meth:`add` counted.

    The one place tok/s, FLOPs per token and MFU are computed: the loop owns one and puts :meth:`rates` into each
    train row. A per-interval rate (not the run average) shows slowdowns as they happen. The first row is measured
    from the baseline, which is where this process started: zero for a new run, and the checkpoint's tokens and
    elapsed time for a resumed one, so the resumed steps never count as tokens processed in no time. Rates are per
    device: the counts are summed over ``processes`` ranks and divided by them.
    """

    def __init__(self, tokens: float = 0.0, elapsed_s: float = 0.0, *, processes: int = 1,
                 flops: StepFlops | None = None) -> None:
        self._tokens = float(tokens)
        self._elapsed = float(elapsed_s)
        self.processes, self.flops = processes, flops
        self._inputs = self._squares = 0.0

    def update(self, tokens: float, elapsed_s: float) -> float:
        """Tokens per second since the previous call (or the baseline); 0.0 when no time has passed."""
        seconds = elapsed_s - self._elapsed
        rate = (tokens - self._tokens) / seconds if seconds > 0 else 0.0
        self._tokens, self._elapsed = float(tokens), float(elapsed_s)
        return rate

    def add(self, inputs: float, squares: float) -> None:
        """Count one step: its input tokens and the sum of its samples' squared lengths, over all ranks."""
        self._inputs += inputs
        self._squares += squares

    def rates(self, tokens: float, elapsed_s: float) -> dict[str, float]:
        """The row's ``tokens_per_s`` (input tokens), ``target_tokens_per_s``, ``flops_per_token`` and ``mfu``
        since the previous row, per device; the FLOPs fields only with a FLOPs model, ``mfu`` only with a peak."""
        seconds = elapsed_s - self._elapsed
        targets = self.update(tokens, elapsed_s) / self.processes
        inputs, squares = self._inputs, self._squares
        self._inputs = self._squares = 0.0
        per_device = 1.0 / (seconds * self.processes) if seconds > 0 else 0.0
        row = {"tokens_per_s": round(inputs * per_device, 1), "target_tokens_per_s": round(targets, 1)}
        if self.flops is not None and inputs > 0:
            flops = self.flops.of(inputs, squares)
            row["flops_per_token"] = round(flops / inputs, 1)
            if self.flops.peak and per_device:
                row["mfu"] = round(flops * per_device / self.flops.peak, 6)
        return row


class Eta:
    """Seconds left in the run, at this process's own pace.

    The pace is measured from the first train row this process logs to the latest one, by their ``elapsed_s``
    (the loop's clock): steps restored from a checkpoint, and the start-up before the first step, are never taken
    for work done in no time. None until two rows have been seen (or when the run's length is unknown).
    """

    def __init__(self, max_steps: int | None) -> None:
        self.max_steps = max_steps
        self._first: tuple[int, float] | None = None

    def update(self, step: int, elapsed_s: float) -> float | None:
        """The estimate after the train row of ``step`` logged at ``elapsed_s``."""
        if self.max_steps is None:
            return None
        if self._first is None:
            self._first = (step, elapsed_s)
            return None
        first_step, first_elapsed = self._first
        if step <= first_step or elapsed_s <= first_elapsed:
            return None
        return max(0, self.max_steps - step) * (elapsed_s - first_elapsed) / (step - first_step)


def format_train_line(row: Row, *, max_steps: int | None, lead: Sequence[str] = LOSS_FIRST.train) -> str:
    """``step 10/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120 | mfu 41.3% | mem 61.2/70.0 GB``
    (+ loss_scale, skipped; a mixture-of-experts run's ``aux_loss`` after the lead metrics).

    ``lead``: the metrics after the step, in order (a :class:`Headline`'s ``train``): the loss by default; a GRPO
    run's ``reward`` and, only where its value carries information, the loss (``step 10/200 | reward 0.4375 | lr
    ...``). Fields missing from the row (or None) are left out; ``/max_steps`` is left out when the length is
    unknown. tok/s is the row's ``tokens_per_s`` (input tokens per second per device, see :class:`Throughput`); mem
    is the device's peak allocated / reserved memory.
    """
    total = f"/{max_steps}" if max_steps is not None else ""
    parts = [f"step {row['step']}{total}"]
    for key, spec in (*((key, ".4f") for key in lead), ("aux_loss", ".4f"), ("lr", ".2e"), ("grad_norm", ".2f")):
        if row.get(key) is not None:
            parts.append(f"{key} {format(float(row[key]), spec)}")
    if row.get("tokens_per_s") is not None:
        parts.append(f"tok/s {float(row['tokens_per_s']):.0f}")
    if row.get("mfu") is not None:
        parts.append(f"mfu {100 * float(row['mfu']):.1f}%")
    if row.get("mem_alloc_gb") is not None and row.get("mem_reserved_gb") is not None:
        parts.append(f"mem {float(row['mem_alloc_gb']):.1f}/{float(row['mem_reserved_gb']):.1f} GB")
    if row.get("loss_scale") is not None:
        parts.append(f"loss_scale {float(row['loss_scale']):.0f}")
    if row.get("nonfinite"):
        parts.append("skipped (non-finite)")
    elif row.get("skipped"):
        parts.append("skipped (overflow)")
    return " | ".join(parts)


def format_eval_line(row: Row) -> str:
    """``eval step 50 | eval_loss = 1.2345 | eval_ppl = 3.4364 | eval_samples = 32 | eval_exact_match 26/32 =
    0.8125``: every value once, as :func:`format_metrics` shows it."""
    return " | ".join([f"eval step {row['step']}", *format_metrics(row, skip=("step",))])


def _timestamp() -> str:
    """Local wall time, ``2026-11-21 22:30:01``."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


class TrainLogTracker:
    """Appends human-readable, timestamped lines to ``<run_dir>/train.log``: one per train row, eval row and event.

    ``max_steps`` is the run's length (shown as ``step 10/200``; None when not known); ``lead``: the metrics a step
    line starts with (:class:`Headline`).
    """

    def __init__(self, run_dir: Path, max_steps: int | None, lead: Sequence[str] = LOSS_FIRST.train) -> None:
        self.max_steps, self.lead = max_steps, tuple(lead)
        self._file = _LineFile(Path(run_dir) / rundir.TRAIN_LOG)

    def log(self, kind: str, row: Row) -> None:
        """Write the row's line: :func:`format_train_line`, :func:`format_eval_line`, or the message as it is (an
        end row has no line of its own)."""
        if kind == "train":
            text = format_train_line(row, max_steps=self.max_steps, lead=self.lead)
        elif kind == "eval":
            text = format_eval_line(row)
        elif kind == "info":
            text = str(row["message"])
        else:  # the end row: the run's summary follows as info lines
            return
        self._file.write(f"{_timestamp()} {text}")

    def close(self) -> None:
        """Close train.log."""
        self._file.close()


def _is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False for pipes, files, captured or closed streams)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _duration(seconds: float | None) -> str:
    """``1:02:03`` (hours:minutes:seconds), or ``-`` when unknown."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class _RichBar:
    """The live rich progress bar behind :class:`ProgressTracker` (only built when it will be seen); ``lead``: the
    metrics it shows before the lr (:class:`Headline`)."""

    def __init__(self, max_steps: int | None, start_step: int, stream: TextIO,
                 lead: Sequence[str] = LOSS_FIRST.train) -> None:
        from rich.console import Console  # lazy: heavy
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn  # lazy: heavy

        self.lead = tuple(lead)
        shown = "".join(f"{key} {{task.fields[{key}]}}  " for key in self.lead)
        self._progress = Progress(
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn(shown + "lr {task.fields[lr]}  {task.fields[tok_s]} tok/s  eta {task.fields[eta]}"),
            console=Console(file=stream),
        )
        # A resumed run's bar starts at its checkpoint's step: those steps are done, not to come.
        self._task = self._progress.add_task("train", total=max_steps, completed=start_step,
                                             **dict.fromkeys(self.lead, "-"), lr="-", tok_s="-", eta="-")
        self._progress.start()

    def update(self, row: Row, eta_s: float | None) -> None:
        """Move the bar to the row's step and show its lead metrics, lr and tok/s, and the ETA."""
        specs = [*((key, ".4f") for key in self.lead), ("lr", ".2e")]
        fields = {key: f"{float(row[key]):{spec}}" for key, spec in specs if row.get(key) is not None}
        if row.get("tokens_per_s") is not None:
            fields["tok_s"] = f"{float(row['tokens_per_s']):.0f}"
        self._progress.update(self._task, completed=row["step"], eta=_duration(eta_s), **fields)

    def print(self, text: str) -> None:
        """Print a line above the bar, verbatim (no rich markup, so ``[...]`` in it is kept)."""
        self._progress.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        """Stop the live display, leaving the final bar on screen."""
        self._progress.stop()


class ProgressTracker:
    """What a run shows on stdout: a live bar on a terminal, else exactly one line per row.

    On a terminal (and with ``bar``, i.e. ``logging.progress``), a rich bar shows step/max_steps, loss, lr, tok/s
    and the ETA (:class:`Eta`), with eval and event lines printed above it. Otherwise (a pipe, a file, or
    ``logging.progress: false``) every train row is one line, as in train.log without the timestamp, and so is
    every eval row and event; warnings (info rows with ``"level": "warning"``) go to stderr. ``start_step`` is
    where a resumed run begins: the bar starts there. ``lead``: the metrics a step line (and the bar) shows first
    (:class:`Headline`; GRPO: the reward).
    """

    def __init__(self, max_steps: int | None, start_step: int = 0, *, bar: bool = True,
                 stream: TextIO | None = None, warn_stream: TextIO | None = None,
                 lead: Sequence[str] = LOSS_FIRST.train) -> None:
        self.max_steps, self.lead = max_steps, tuple(lead)
        self.completed = start_step  # the last step shown: start_step until the first train row
        self.eta_s: float | None = None  # seconds left, as last shown: None until the pace is known
        self._eta = Eta(max_steps)
        self._out = sys.stdout if stream is None else stream
        self._err = sys.stderr if warn_stream is None else warn_stream
        self._bar = _RichBar(max_steps, start_step, self._out, self.lead) if bar and _is_terminal(self._out) \
            else None

    @property
    def active(self) -> bool:
        """Whether a live bar is being shown."""
        return self._bar is not None

    def log(self, kind: str, row: Row) -> None:
        """Advance the bar (or print the train line); print eval and event lines."""
        if kind == "train":
            self.completed = int(row["step"])
            if row.get("elapsed_s") is not None:
                self.eta_s = self._eta.update(self.completed, float(row["elapsed_s"]))
            if self._bar is not None:
                self._bar.update(row, self.eta_s)
            else:
                self._line(format_train_line(row, max_steps=self.max_steps, lead=self.lead))
        elif kind == "eval":
            self._line(format_eval_line(row))
        elif kind == "info" and row.get("console") is not False:
            self._line(str(row["message"]), warning=row.get("level") == "warning")

    def close(self) -> None:
        """Stop the bar (the lines need nothing)."""
        if self._bar is not None:
            self._bar.close()

    def _line(self, text: str, warning: bool = False) -> None:
        if self._bar is not None:
            self._bar.print(text)
        else:
            print(text, file=self._err if warning else self._out, flush=True)


def _prefixed(prefix: str, row: Row) -> dict[str, float | int]:
    """``{"prefix/key": value}`` for every numeric key but ``step`` (the x axis, passed separately)."""
    return {f"{prefix}/{key}": value for key, value in row.items()
            if key != "step" and isinstance(value, int | float)}


def wandb_run_id(run_dir: Path) -> str:
    """The wandb run id of this run dir: read from ``wandb_run_id.txt``, or created and saved there.

    Persisting it is what makes a resumed run continue the same wandb run instead of starting a new one.
    """
    path = Path(run_dir) / rundir.WANDB_RUN_ID
    if path.is_file() and (saved := path.read_text(encoding="utf-8").strip()):
        return saved
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(rundir.open_checked(path, os.O_WRONLY | os.O_TRUNC), "w", encoding="utf-8") as handle:
        handle.write(run_id + "\n")
    return run_id


NO_WANDB = ("logging.wandb.enabled is true but wandb is not installed: pip install wandb, or set "
            "logging.wandb.enabled: false")  # wandb is optional: finetune runs without it where an image lacks it


class WandbTracker:
    """Weights & Biases sink: train rows as ``train/<key>``, eval rows as ``eval/<key>``, x axis = ``step``.

    Everything wandb writes stays inside ``<run_dir>/wandb`` (nothing in $HOME), and the run id is persisted so
    a resumed run continues the same wandb run. The mode comes from the recipe and defaults to offline: an online
    run without an API key would wait forever at a login prompt on a terminal.
    """

    def __init__(self, cfg: RecipeConfig, run_dir: Path) -> None:
        # Checked first: without wandb (optional; absent where an image lacks it) nothing is created, so a run that
        # trained nothing leaves no folder behind (finetune.storage.unstarted keeps a tracker folder it did not list)
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(NO_WANDB)
        run_dir = Path(run_dir)
        wandb_dir = run_dir / rundir.WANDB
        wandb_dir.mkdir(parents=True, exist_ok=True)
        self._dir, self._before = wandb_dir, rundir.tree_names(wandb_dir)  # what this run adds is recorded at close
        # WANDB_DIR is the folder wandb creates its "wandb/" in, so the run dir itself (as dir= below).
        os.environ.update({
            "WANDB_DIR": str(run_dir),
            "WANDB_CONFIG_DIR": str(wandb_dir / "config"),
            "WANDB_CACHE_DIR": str(wandb_dir / "cache"),
            "WANDB_DATA_DIR": str(wandb_dir / "data"),
            "WANDB_SILENT": "true",
        })
        try:
            import wandb  # lazy: heavy; after the environment above, which it reads
        except ImportError as exc:
            raise ConfigError(NO_WANDB) from exc
        settings = cfg.logging.wandb
        self.run_id = wandb_run_id(run_dir)
        self._run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=cfg.name,
            mode=settings.mode,
            dir=str(run_dir),
            id=self.run_id,
            resume="allow",
            config=cfg.model_dump(mode="json"),
        )

    def log(self, kind: str, row: Row) -> None:
        """Log a train or eval row under ``train/`` or ``eval/``; events are not sent (train.log has them)."""
        if kind in ("train", "eval"):
            self._run.log(_prefixed(kind, row), step=int(row["step"]))

    def close(self) -> None:
        """Finish the wandb run (offline: writes it to disk for a later ``wandb sync``), then record what it wrote
        in ``wandb/manifest.json`` (what ``--overwrite`` may delete)."""
        self._run.finish()
        rundir.record_tree(self._dir, self._before)


class TensorboardTracker:
    """TensorBoard sink: one scalar per numeric key under ``train/`` or ``eval/``, in ``<run_dir>/tensorboard``.

    Imports torch's SummaryWriter only when built, since importing torch costs over a second.
    """

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # lazy: heavy
        except ImportError as exc:
            raise ConfigError("logging.tensorboard is true but tensorboard is not installed: pip install "
                              "tensorboard, or set logging.tensorboard: false") from exc
        self._dir = Path(run_dir) / rundir.TENSORBOARD
        rundir.check_write_tree(self._dir)
        self._before = rundir.tree_names(self._dir)  # what this run adds is recorded at close
        self._writer = SummaryWriter(log_dir=str(self._dir))

    def log(self, kind: str, row: Row) -> None:
        """Add a ``train/<key>`` or ``eval/<key>`` scalar per numeric key; events are not sent (train.log has them)."""
        if kind not in ("train", "eval"):
            return
        step = int(row["step"])
        for tag, value in _prefixed(kind, row).items():
            self._writer.add_scalar(tag, float(value), global_step=step)

    def close(self) -> None:
        """Flush and close the event file, then record it in ``tensorboard/manifest.json`` (what ``--overwrite``
        may delete)."""
        self._writer.close()
        rundir.record_tree(self._dir, self._before)


def build_tracker(cfg: RecipeConfig, run_dir: Path, *, is_main: bool, start_step: int = 0,
                  max_steps: int | None = None) -> Tracker:
    """Rank 0: jsonl + train.log + progress on stdout (+ wandb, tensorboard per cfg.logging); other ranks:
    NullTracker.

    ``max_steps`` is the run's length when the caller knows better than the recipe (a recipe that sets
    ``train.epochs`` has no ``train.max_steps``); by default ``cfg.train.max_steps``. ``start_step`` is where a
    resumed run begins (its checkpoint's step): the progress bar starts there. Step lines lead with the recipe's
    :class:`Headline` (:func:`cfg_headline`).
    """
    if not is_main:
        return NullTracker()
    run_dir = Path(run_dir)
    steps = max_steps if max_steps is not None else cfg.train.max_steps
    lead = cfg_headline(cfg).train
    trackers: list[Tracker] = [JsonlTracker(run_dir), TrainLogTracker(run_dir, steps, lead)]
    if cfg.logging.wandb.enabled:
        trackers.append(WandbTracker(cfg, run_dir))
    if cfg.logging.tensorboard:
        trackers.append(TensorboardTracker(run_dir))
    # Last, so a sink that fails to start does not leave a live bar behind.
    trackers.append(ProgressTracker(steps, start_step, bar=cfg.logging.progress, lead=lead))
    return MultiTracker(trackers)


__all__ = [
    "KINDS",
    "NO_WANDB",
    "Eta",
    "JsonlTracker",
    "MultiTracker",
    "NullTracker",
    "ProgressTracker",
    "TensorboardTracker",
    "Throughput",
    "Tracker",
    "TrainLogTracker",
    "WandbTracker",
    "build_tracker",
    "format_eval_line",
    "format_train_line",
    "wandb_run_id",
]
