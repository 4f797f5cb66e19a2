"""A run's metrics file as data: reading ``metrics.jsonl`` back, cutting it at a resumed step, the values shown as
lines, and what a run reports first (its :class:`Headline`).

The trackers that write the file (finetune.runtime.tracking) run in the training process; everything that reads it
(the summary, the plot, ``finetune ls``, a resume that cuts it) needs only this module, which imports no torch.
What a run's step lines, its end-of-run summary and its plot lead with is its :class:`Headline`, a function of its
recipe (:func:`headline`): the train loss for every task but GRPO, whose user watches the reward (see there).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import objectives
from finetune.config.schema import RecipeConfig
from finetune.errors import RunDirError
from finetune.storage import rundir

Row = Mapping[str, Any]
"""A row: name -> value. Train and eval rows always hold ``step``; an info row holds ``message``."""


_COUNT_SUFFIXES = ("_correct", "_total")


_NOT_METRICS = ("eval_loss", "eval_ppl", "eval_samples", "eval_correct", "eval_total")


@dataclass(frozen=True)
class Headline:
    """What a run reports first, in its step lines (:func:`format_train_line`), its summary
    (:mod:`finetune.storage.summary`) and its plot (:mod:`finetune.storage.plot`).


    ``train``: the train-row keys a step line starts with, in order, and the ones the summary gives as final values;
    a key left out of it is not shown there at all (it stays in metrics.jsonl). ``eval``: the eval-row keys the
    summary's final eval puts first, in order. ``panels``: the panels the plot draws first, in order (the task
    record's ``panels``; empty: the plot's default order)."""


    train: tuple[str, ...] = ("loss",)
    eval: tuple[str, ...] = ()
    panels: tuple[str, ...] = ()


    @property
    def loss(self) -> bool:
        """Whether the train loss is shown (a step line, the summary, the plot's loss panel)."""
        return "loss" in self.train


LOSS_FIRST = Headline()
"""Every task but GRPO: the train loss leads; eval metrics in the order they are logged."""


def grpo_loss_informative(iterations: Any, beta: Any) -> bool:
    """Whether a GRPO run's train loss VALUE says anything: with ``grpo.iterations`` > 1 (the ratio moves off 1 on a
    cycle's later steps and is clipped) or ``grpo.beta`` > 0 (the KL to the reference is in it).


    With one update per generation batch and no KL the old log-probs are the policy's own (detached), so every ratio
    is exactly 1 and the loss is minus the advantage-weighted mean of 1: for ``grpo.loss: grpo`` the mean advantage,
    0 up to rounding (advantages are centred in every group), for ``token`` / ``dr_grpo`` a length-weighted mean of
    the advantages, a by-product of the normalisation. Its gradient is the policy gradient all the same; only its
    value carries nothing to watch. Values that are not numbers count as the defaults (1, 0)."""
    def number(value: Any) -> float:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


    return number(iterations) > 1 or number(beta) > 0


def headline(task: Any, iterations: Any = 1, beta: Any = 0.0) -> Headline:
    """The :class:`Headline` of a run whose recipe has ``task`` (and ``grpo.iterations`` / ``grpo.beta``).


    A task whose record names a ``headline`` leads with its keys (GRPO: the mean total ``reward`` of the step's
    completions, then the loss only where its value carries information, :func:`grpo_loss_informative`; the eval's
    ``eval_exact_match`` and ``eval_reward`` first). Every other task, and a ``task`` that is not one (a recipe read
    back as plain data): :data:`LOSS_FIRST` (what every run showed before GRPO). The plot's ``panels`` are the
    record's."""
    record = objectives.objective(task)
    panels = (record.panels or ()) if record is not None else ()
    if record is None or record.headline is None:
        return Headline(panels=panels) if panels else LOSS_FIRST
    train, evaluation = record.headline
    informative = grpo_loss_informative(iterations, beta)
    return Headline(tuple(key for key in train if key != "loss" or informative), evaluation, panels)


def recipe_headline(recipe: Mapping[str, Any]) -> Headline:
    """:func:`headline` from a recipe as plain data (a run's ``recipe.resolved.yaml``, read back by the summary and
    the plot); a missing or malformed ``grpo`` section counts as the defaults."""
    grpo = recipe.get("grpo")
    grpo = grpo if isinstance(grpo, Mapping) else {}
    return headline(recipe.get("task"), grpo.get("iterations", 1), grpo.get("beta", 0.0))


def cfg_headline(cfg: RecipeConfig) -> Headline:
    """:func:`headline` of a validated recipe (the run's own trackers)."""
    return headline(cfg.task, cfg.grpo.iterations, cfg.grpo.beta)


def _metrics_text(path: Path) -> str:
    """The text of metrics.jsonl at ``path``, read only from a regular file: never through a symbolic link, never
    from a FIFO or a device (a link to /dev/zero would never end, a FIFO would block), each refused in one line
    that says what is there instead; a missing file is "not found"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RunDirError(f"{path} not found: {path.parent} is not a run directory, or no metrics were logged "
                          "yet") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise RunDirError(f"{path}: not a regular file (a symbolic link); finetune reads only the {rundir.METRICS} "
                          "it wrote there: move it away") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a folder" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
        raise RunDirError(f"{path}: not a regular file ({what}); finetune reads only the {rundir.METRICS} it wrote "
                          "there: move it away")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise RunDirError(f"{path}: not UTF-8 text, so not the {rundir.METRICS} finetune writes") from None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Read ``<run_dir>/metrics.jsonl`` back as a list of rows (each with its ``kind``), in the order logged.


    A truncated last line (a run killed mid-write) is skipped; a bad line anywhere else is an error, one line naming
    the file and the line: not JSON, not a JSON object, a number beyond what Python reads, or nested too deep
    (a RecursionError in the parser). Only a regular file is read (see :func:`_metrics_text`).
    """
    path = Path(run_dir) / rundir.METRICS
    lines = [(number, line) for number, line in enumerate(_metrics_text(path).splitlines(), 1) if line.strip()]
    rows: list[dict[str, Any]] = []
    for index, (number, line) in enumerate(lines):
        try:
            row = json.loads(line)
            why = None if isinstance(row, dict) else f"a JSON {type(row).__name__}"
        except json.JSONDecodeError as exc:
            why = exc.msg
        except RecursionError:  # a row nested thousands deep: the parser runs out of stack
            why = "nested too deep"
        except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
            why = "a number with too many digits"
        if why is None:
            rows.append(row)
        elif index == len(lines) - 1:
            break
        else:
            raise RunDirError(f"{path}:{number}: not a JSON object ({why})")
    return rows


def truncate_metrics(run_dir: Path, step: int) -> int:
    """Drop the rows logged after ``step`` (by a process that died or stopped after its last checkpoint), and the
    run's end row (:mod:`finetune.storage.summary`) with what follows it: a resumed run is not finished.


    A resumed run re-logs those steps, so metrics.jsonl ends up with every step exactly once. The file is cut in
    place at the first row after ``step`` (rows are appended in step order), so a tracker that already holds it
    open for appending keeps writing to the same file. Called only once the checkpoint has loaded. Returns the
    number of rows dropped.
    """
    path = Path(run_dir) / rundir.METRICS
    if not path.is_file():
        return 0
    read_metrics(run_dir)  # a corrupted file (not just a torn last line) is an error before anything is cut
    with os.fdopen(rundir.open_checked(path, os.O_RDWR), "r+b") as handle:
        offset, cut, dropped = 0, None, 0
        for line in handle:
            if cut is None:
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None  # a torn last line
                if row is None or not isinstance(row, dict) or row.get("step", 0) > step or row.get("kind") == "end":
                    cut = offset  # (an end row: the run continues, so it is no longer finished)
            if cut is not None and line.strip():
                dropped += 1
            offset += len(line)
        if cut is not None:
            handle.truncate(cut)
    return dropped


def _number(value: Any, spec: str = ".4f") -> str:
    """Ints (and bools) as integers, floats with ``spec``, anything else as text."""
    if isinstance(value, bool | int):
        return str(int(value))
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def format_metrics(row: Row, *, skip: Collection[str] = ()) -> list[str]:
    """Each value of ``row`` once, in row order: ``name correct/total = value`` for a metric with counts
    (``eval_exact_match 198/200 = 0.9900``), ``name = value`` for the rest (``eval_loss = 1.2345``).


    A metric's counts are ``<name>_correct`` / ``<name>_total``; they are shown with it and not again on their own.
    ``eval_correct`` / ``eval_total`` are the first metric's counts: not shown again when a metric shows counts;
    given to the only metric when it has none of its own (rows without per-metric counts); else listed as they
    are. Floats get 4 decimals. Keys in ``skip`` are left out. Used by ``finetune eval`` and train.log alike.
    """
    keys = [key for key in row if key not in skip]
    counted = {key for key in keys if f"{key}_correct" in row and f"{key}_total" in row}
    metrics = [key for key in keys if key.startswith("eval_") and key not in _NOT_METRICS
               and not key.endswith(_COUNT_SUFFIXES)]
    generic = "eval_correct" in row and "eval_total" in row
    adopter = metrics[0] if generic and len(metrics) == 1 and not counted else None
    hidden = {f"{key}{suffix}" for key in counted for suffix in _COUNT_SUFFIXES}
    if generic and (counted or adopter):
        hidden |= {"eval_correct", "eval_total"}
    lines = []
    for key in keys:
        if key in hidden:
            continue
        prefix = key if key in counted else ("eval" if key == adopter else None)
        counts = (f" {_number(row[f'{prefix}_correct'], '.0f')}/{_number(row[f'{prefix}_total'], '.0f')}"
                  if prefix else "")
        lines.append(f"{key}{counts} = {_number(row[key])}")
    return lines
