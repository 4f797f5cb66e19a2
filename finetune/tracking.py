"""Metric sinks for the training loop.

The loop hands every sink the same two kinds of rows (train and eval) plus plain event lines, through one
:class:`Tracker` protocol. Each sink is a small class that does one thing; :class:`MultiTracker` fans out to
several and :class:`NullTracker` stands in wherever nothing should happen (non-zero ranks, a progress bar
without a terminal), so the loop never branches on "is this sink on?".

On rank 0 :func:`build_tracker` always writes ``metrics.jsonl`` (machine-readable, read back by
:func:`read_metrics`) and ``train.log`` (human-readable), shows a rich progress bar on a terminal, and adds
Weights & Biases and TensorBoard when the recipe enables them. wandb and tensorboard (which imports torch) are
imported only when enabled, so importing this module stays cheap for the CLI.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from finetune import rundir
from finetune.config.schema import RecipeConfig
from finetune.errors import ConfigError, RunDirError

Row = Mapping[str, Any]
"""A train or eval row: metric name -> number (``step`` always present)."""


# Eval keys printed first, in this order, with these formats; every other eval_* key is a metric.
_EVAL_HEAD = {"eval_loss": ".4f", "eval_ppl": ".2f"}
_COUNT_SUFFIXES = ("_correct", "_total")


class Tracker(Protocol):
    """Where the training loop sends metrics and events."""

    def log_train(self, row: dict[str, float | int]) -> None:
        """A train row: step, loss, lr, grad_norm, tokens (cumulative), elapsed_s, optionally loss_scale, skipped."""

    def log_eval(self, row: dict[str, float | int]) -> None:
        """An eval row: step, eval_loss, eval_ppl, eval_<metric> (+ eval_correct / eval_total counts)."""

    def info(self, message: str) -> None:
        """A plain event line, e.g. ``saved checkpoint step-000100``."""

    def close(self) -> None:
        """Flush and release whatever the sink holds; called once at the end of the run."""


class NullTracker:
    """A sink that does nothing: what non-zero ranks get, and what disabled sinks delegate to."""

    def log_train(self, row: dict[str, float | int]) -> None:
        """Ignore the row."""

    def log_eval(self, row: dict[str, float | int]) -> None:
        """Ignore the row."""

    def info(self, message: str) -> None:
        """Ignore the message."""

    def close(self) -> None:
        """Nothing to release."""


class MultiTracker:
    """Fans every call out to several trackers, in order; close() closes all of them even if one raises."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers: list[Tracker] = list(trackers)

    def log_train(self, row: dict[str, float | int]) -> None:
        """Send a train row to every tracker."""
        for tracker in self.trackers:
            tracker.log_train(row)

    def log_eval(self, row: dict[str, float | int]) -> None:
        """Send an eval row to every tracker."""
        for tracker in self.trackers:
            tracker.log_eval(row)

    def info(self, message: str) -> None:
        """Send an event line to every tracker."""
        for tracker in self.trackers:
            tracker.info(message)

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
        self._fh = path.open("a", encoding="utf-8")

    def write(self, line: str) -> None:
        """Append one line (the newline is added here) and flush it to the OS."""
        self._fh.write(line + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._fh.close()


class JsonlTracker:
    """Appends one JSON object per row to ``<run_dir>/metrics.jsonl``, tagged ``"kind": "train"`` or ``"eval"``.

    This is the machine-readable record of a run (tests and the CLI read it with :func:`read_metrics`); event
    lines are not metrics and go to train.log only. Non-finite floats are written as ``NaN`` / ``Infinity``,
    which Python's json reads back.
    """

    def __init__(self, run_dir: Path) -> None:
        self._file = _LineFile(Path(run_dir) / rundir.METRICS)

    def log_train(self, row: dict[str, float | int]) -> None:
        """Append the row with ``kind: train``."""
        self._write("train", row)

    def log_eval(self, row: dict[str, float | int]) -> None:
        """Append the row with ``kind: eval``."""
        self._write("eval", row)

    def info(self, message: str) -> None:
        """Events are not metrics: nothing is written."""

    def close(self) -> None:
        """Close metrics.jsonl."""
        self._file.close()

    def _write(self, kind: str, row: Row) -> None:
        record = {"kind": kind, **{key: value for key, value in row.items() if key != "kind"}}
        self._file.write(json.dumps(record))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Read ``<run_dir>/metrics.jsonl`` back as a list of rows (each with its ``kind``), in the order logged.

    A truncated last line (a run killed mid-write) is skipped; a bad line anywhere else is an error.
    """
    path = Path(run_dir) / rundir.METRICS
    if not path.is_file():
        raise RunDirError(f"{path} not found: {run_dir} is not a run directory, or no metrics were logged yet")
    lines = [(number, line) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    rows: list[dict[str, Any]] = []
    for index, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if index == len(lines) - 1:
                break
            raise RunDirError(f"{path}:{number}: not a JSON object ({exc.msg})") from exc
    return rows


def truncate_metrics(run_dir: Path, step: int) -> int:
    """Drop the rows logged after ``step`` (by a process that died or stopped after its last checkpoint).

    A resumed run re-logs those steps, so metrics.jsonl ends up with every step exactly once. The file is cut in
    place at the first row after ``step`` (rows are appended in step order), so a tracker that already holds it
    open for appending keeps writing to the same file. Called only once the checkpoint has loaded. Returns the
    number of rows dropped.
    """
    path = Path(run_dir) / rundir.METRICS
    if not path.is_file():
        return 0
    read_metrics(run_dir)  # a corrupted file (not just a torn last line) is an error before anything is cut
    with path.open("r+b") as handle:
        offset, cut, dropped = 0, None, 0
        for line in handle:
            if cut is None:
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None  # a torn last line
                if row is None or not isinstance(row, dict) or row.get("step", 0) > step:
                    cut = offset
            if cut is not None and line.strip():
                dropped += 1
            offset += len(line)
        if cut is not None:
            handle.truncate(cut)
    return dropped


class Throughput:
    """Tokens per second between successive train rows, from cumulative ``tokens`` and ``elapsed_s``.

    A per-interval rate (not the run average) shows slowdowns as they happen. The first row has no predecessor,
    so it is measured from the start: tokens / elapsed_s.
    """

    def __init__(self) -> None:
        self._tokens = 0.0
        self._elapsed = 0.0

    def update(self, row: Row) -> float | None:
        """Rate since the previous row; None when the row lacks tokens or elapsed_s."""
        tokens, elapsed = row.get("tokens"), row.get("elapsed_s")
        if tokens is None or elapsed is None:
            return None
        seconds = elapsed - self._elapsed
        rate = (tokens - self._tokens) / seconds if seconds > 0 else 0.0
        self._tokens, self._elapsed = float(tokens), float(elapsed)
        return rate


def _number(value: Any, spec: str = ".4f") -> str:
    """Ints (and bools) as integers, floats with ``spec``."""
    if isinstance(value, bool | int):
        return str(int(value))
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def format_train_line(row: Row, *, max_steps: int | None, tokens_per_s: float | None) -> str:
    """``step 10/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120`` (+ loss_scale, skipped).

    Fields missing from the row (or None) are left out; ``/max_steps`` is left out when the length is unknown.
    """
    total = f"/{max_steps}" if max_steps is not None else ""
    parts = [f"step {row['step']}{total}"]
    for key, spec in (("loss", ".4f"), ("lr", ".2e"), ("grad_norm", ".2f")):
        if row.get(key) is not None:
            parts.append(f"{key} {format(float(row[key]), spec)}")
    if tokens_per_s is not None:
        parts.append(f"tok/s {tokens_per_s:.0f}")
    if row.get("loss_scale") is not None:
        parts.append(f"loss_scale {float(row['loss_scale']):.0f}")
    if row.get("nonfinite"):
        parts.append("skipped (non-finite)")
    elif row.get("skipped"):
        parts.append("skipped (overflow)")
    return " | ".join(parts)


def format_eval_line(row: Row) -> str:
    """``eval step 50 | eval_loss 1.2345 | eval_ppl 3.44 | eval_exact_match 0.8125 (26/32)``.

    Every eval_<metric> is listed with its counts: ``eval_<metric>_correct`` / ``_total`` when the row has them,
    else the row's ``eval_correct`` / ``eval_total`` when there is exactly one metric to attribute them to
    (otherwise they are shown on their own as ``correct 26/32``).
    """
    parts = [f"eval step {row['step']}"]
    parts += [f"{key} {_number(float(row[key]), spec)}" for key, spec in _EVAL_HEAD.items()
              if row.get(key) is not None]
    if row.get("eval_samples") is not None:
        parts.append(f"samples {int(row['eval_samples'])}")
    metrics = [key for key in row if key.startswith("eval_") and key not in _EVAL_HEAD
               and key not in ("eval_correct", "eval_total", "eval_samples") and not key.endswith(_COUNT_SUFFIXES)]
    generic = _counts(row, "eval")
    own = {key: _counts(row, key) for key in metrics}
    for key in metrics:
        counts = own[key] or (generic if len(metrics) == 1 else None)
        parts.append(f"{key} {_number(row[key])}" + (f" ({counts})" if counts else ""))
    if generic and len(metrics) != 1 and not any(own.values()):  # counts no metric line already shows
        parts.append(f"correct {generic}")
    return " | ".join(parts)


def _counts(row: Row, prefix: str) -> str | None:
    """``correct/total`` from ``<prefix>_correct`` and ``<prefix>_total``, or None when either is missing."""
    correct, total = row.get(f"{prefix}_correct"), row.get(f"{prefix}_total")
    if correct is None or total is None:
        return None
    return f"{_number(correct, '.0f')}/{_number(total, '.0f')}"


def _timestamp() -> str:
    """Local wall time, ``2026-11-21 22:30:01``."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


class TrainLogTracker:
    """Appends human-readable, timestamped lines to ``<run_dir>/train.log``: one per train row, eval row and event.

    ``max_steps`` is the run's length (shown as ``step 10/200``; None when not known). tok/s is computed here
    from successive rows, see :class:`Throughput`.
    """

    def __init__(self, run_dir: Path, max_steps: int | None) -> None:
        self.max_steps = max_steps
        self._file = _LineFile(Path(run_dir) / rundir.TRAIN_LOG)
        self._throughput = Throughput()

    def log_train(self, row: dict[str, float | int]) -> None:
        """Write ``step 10/200 | loss ... | tok/s ...``."""
        self._line(format_train_line(row, max_steps=self.max_steps, tokens_per_s=self._throughput.update(row)))

    def log_eval(self, row: dict[str, float | int]) -> None:
        """Write ``eval step 50 | eval_loss ... | eval_<metric> value (correct/total)``."""
        self._line(format_eval_line(row))

    def info(self, message: str) -> None:
        """Write the message as it is."""
        self._line(message)

    def close(self) -> None:
        """Close train.log."""
        self._file.close()

    def _line(self, text: str) -> None:
        self._file.write(f"{_timestamp()} {text}")


def _is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False for pipes, files, captured or closed streams)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class _RichBar:
    """The live rich progress bar behind :class:`ProgressTracker` (only built when it will be seen)."""

    def __init__(self, max_steps: int | None, start_step: int, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[tok_s]} tok/s  eta"),
            TimeRemainingColumn(),
            console=Console(file=stream),
        )
        # The resumed part counts as done without being a "sample", so the ETA reflects this process's speed.
        self._task = self._progress.add_task("train", total=max_steps, completed=start_step,
                                             loss="-", lr="-", tok_s="-")
        self._throughput = Throughput()
        self._progress.start()

    def log_train(self, row: dict[str, float | int]) -> None:
        """Move the bar to the row's step and show its loss, lr and tok/s."""
        rate = self._throughput.update(row)
        fields = {key: f"{float(row[key]):{spec}}" for key, spec in (("loss", ".4f"), ("lr", ".2e"))
                  if row.get(key) is not None}
        if rate is not None:
            fields["tok_s"] = f"{rate:.0f}"
        self._progress.update(self._task, completed=row["step"], **fields)

    def log_eval(self, row: dict[str, float | int]) -> None:
        """Print the eval line above the bar."""
        self.info(format_eval_line(row))

    def info(self, message: str) -> None:
        """Print the message above the bar, verbatim (no rich markup, so ``[...]`` in it is kept)."""
        self._progress.console.print(message, markup=False, highlight=False)

    def close(self) -> None:
        """Stop the live display, leaving the final bar on screen."""
        self._progress.stop()


class ProgressTracker:
    """A rich progress bar (step/max_steps, loss, lr, tok/s, ETA) with event lines printed above it.

    Shown only when ``enabled`` and ``stream`` (default: stderr) is a terminal; otherwise every call is a no-op,
    so logs piped to a file carry no bar redraws. ``start_step`` is where a resumed run begins.
    """

    def __init__(self, max_steps: int | None, start_step: int = 0, *, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        stream = sys.stderr if stream is None else stream
        self._impl: Tracker = (_RichBar(max_steps, start_step, stream) if enabled and _is_terminal(stream)
                               else NullTracker())

    @property
    def active(self) -> bool:
        """Whether a bar is being shown."""
        return not isinstance(self._impl, NullTracker)

    def log_train(self, row: dict[str, float | int]) -> None:
        """Advance the bar."""
        self._impl.log_train(row)

    def log_eval(self, row: dict[str, float | int]) -> None:
        """Print the eval line above the bar."""
        self._impl.log_eval(row)

    def info(self, message: str) -> None:
        """Print the message above the bar."""
        self._impl.info(message)

    def close(self) -> None:
        """Stop the bar."""
        self._impl.close()


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
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


class WandbTracker:
    """Weights & Biases sink: train rows as ``train/<key>``, eval rows as ``eval/<key>``, x axis = ``step``.

    Everything wandb writes stays inside ``<run_dir>/wandb`` (nothing in $HOME), and the run id is persisted so
    a resumed run continues the same wandb run. The mode comes from the recipe and defaults to offline: an online
    run without an API key would wait forever at a login prompt on a terminal.
    """

    def __init__(self, cfg: RecipeConfig, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        wandb_dir = run_dir / rundir.WANDB
        wandb_dir.mkdir(parents=True, exist_ok=True)
        # WANDB_DIR is the folder wandb creates its "wandb/" in, so the run dir itself (as dir= below).
        os.environ.update({
            "WANDB_DIR": str(run_dir),
            "WANDB_CONFIG_DIR": str(wandb_dir / "config"),
            "WANDB_CACHE_DIR": str(wandb_dir / "cache"),
            "WANDB_DATA_DIR": str(wandb_dir / "data"),
            "WANDB_SILENT": "true",
        })
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError("logging.wandb.enabled is true but wandb is not installed: pip install wandb, "
                              "or set logging.wandb.enabled: false") from exc
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

    def log_train(self, row: dict[str, float | int]) -> None:
        """Log the row under ``train/``."""
        self._run.log(_prefixed("train", row), step=int(row["step"]))

    def log_eval(self, row: dict[str, float | int]) -> None:
        """Log the row under ``eval/``."""
        self._run.log(_prefixed("eval", row), step=int(row["step"]))

    def info(self, message: str) -> None:
        """Events are not sent to wandb (train.log has them)."""

    def close(self) -> None:
        """Finish the wandb run (offline: writes it to disk for a later ``wandb sync``)."""
        self._run.finish()


class TensorboardTracker:
    """TensorBoard sink: one scalar per numeric key under ``train/`` or ``eval/``, in ``<run_dir>/tensorboard``.

    Imports torch's SummaryWriter only when built, since importing torch costs over a second.
    """

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("logging.tensorboard is true but tensorboard is not installed: pip install "
                              "tensorboard, or set logging.tensorboard: false") from exc
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / rundir.TENSORBOARD))

    def log_train(self, row: dict[str, float | int]) -> None:
        """Add a ``train/<key>`` scalar per numeric key."""
        self._add("train", row)

    def log_eval(self, row: dict[str, float | int]) -> None:
        """Add an ``eval/<key>`` scalar per numeric key."""
        self._add("eval", row)

    def info(self, message: str) -> None:
        """Events are not sent to TensorBoard (train.log has them)."""

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()

    def _add(self, prefix: str, row: Row) -> None:
        step = int(row["step"])
        for tag, value in _prefixed(prefix, row).items():
            self._writer.add_scalar(tag, float(value), global_step=step)


def build_tracker(cfg: RecipeConfig, run_dir: Path, *, is_main: bool, start_step: int = 0,
                  max_steps: int | None = None) -> Tracker:
    """Rank 0: jsonl + train.log + progress (+ wandb, tensorboard per cfg.logging); other ranks: NullTracker.

    ``max_steps`` is the run's length when the caller knows better than the recipe (a recipe that sets
    ``train.epochs`` has no ``train.max_steps``); by default ``cfg.train.max_steps``. ``start_step`` is where a
    resumed run begins (the progress bar starts there).
    """
    if not is_main:
        return NullTracker()
    run_dir = Path(run_dir)
    steps = max_steps if max_steps is not None else cfg.train.max_steps
    trackers: list[Tracker] = [JsonlTracker(run_dir), TrainLogTracker(run_dir, steps)]
    if cfg.logging.wandb.enabled:
        trackers.append(WandbTracker(cfg, run_dir))
    if cfg.logging.tensorboard:
        trackers.append(TensorboardTracker(run_dir))
    # Last, so a sink that fails to start does not leave a live bar behind.
    trackers.append(ProgressTracker(steps, start_step, enabled=cfg.logging.progress))
    return MultiTracker(trackers)


__all__ = [
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
    "read_metrics",
    "wandb_run_id",
]

