"""The summary a finished run ends with, and that ``finetune ls RUN`` shows again: one reader, one renderer.

Everything in it is read back from what the run wrote, never recomputed: the ``end`` row that the worker appends to
metrics.jsonl once the run has finished (step, samples, tokens, training and wall time), the last train row (the
final train loss), the last eval row (every final eval metric with its counts, as ``finetune eval`` prints them),
the recipe (a PEFT run can be merged; a classification or reward model generates no text) and the files present
(``final/``, ``plots.png``, the logs). A run is finished when its metrics.jsonl ends with an end row: a resume that
continues it drops that row (:func:`finetune.storage.metrics.truncate_metrics`).

What it leads with is the run's :class:`finetune.storage.metrics.Headline`, from its recipe: the final train loss for
every task but GRPO; for GRPO the final train reward (and the loss only where its value carries information), and the
final eval's exact match and mean reward first.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from finetune import registry
from finetune.errors import FinetuneError, RunDirError
from finetune.registry import SupportedModel
from finetune.storage import rundir
from finetune.storage.metrics import LOSS_FIRST, Headline, format_metrics, read_metrics, recipe_headline


@dataclass(frozen=True)
class Summary:
    """What a finished run reports: its end row, final train and eval rows, recipe facts and output paths, and what
    it leads with (``headline``)."""

    run_dir: Path
    end: dict[str, Any]
    train: dict[str, Any] | None
    eval: dict[str, Any] | None
    peft: bool
    generates: bool
    final: Path | None
    plot: Path | None
    headline: Headline = LOSS_FIRST


def _recipe(run_dir: Path) -> dict[str, Any]:
    """The run's resolved recipe as plain data ({} when it cannot be read: the summary then leaves out what needs
    it)."""
    try:
        data = yaml.safe_load((run_dir / rundir.RESOLVED).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def run_headline(run_dir: Path) -> Headline:
    """The :class:`Headline` of the run in ``run_dir``, from its resolved recipe (loss first when it cannot be read):
    what its summary and its plot (:mod:`finetune.storage.plot`) lead with."""
    return recipe_headline(_recipe(run_dir))


def _generates(recipe: dict[str, Any], row: SupportedModel | None) -> bool:
    """Whether the run's model writes text (``finetune generate``): its row's ``generation`` capability, as the
    recipe's task builds it (a classification or reward head scores instead; an unknown row: not said). ``row``:
    the run's row where the caller holds it (the worker); else resolved from the resolved recipe."""
    if row is None:  # the two keys the row depends on (the resolved recipe may come from another version)
        model = recipe.get("model") if isinstance(recipe.get("model"), dict) else {}
        keys = SimpleNamespace(model=SimpleNamespace(type=str(model.get("type"))), task=recipe.get("task"))
        try:
            row = registry.recipe_row(keys)
        except FinetuneError:
            return False
    return "generation" in row.capabilities


def read_summary(run_dir: Path, row: SupportedModel | None = None) -> Summary | None:
    """The summary of a finished run; None when the run has not finished (no end row last in metrics.jsonl, or no
    metrics at all). ``row``: the run's row (registry.recipe_row), where the caller has it already."""
    try:
        rows = [row for row in read_metrics(run_dir) if isinstance(row, dict)]
    except (RunDirError, OSError, UnicodeDecodeError):
        return None
    ends = [i for i, row in enumerate(rows) if row.get("kind") == "end"]
    if not ends or any(row.get("kind") == "train" for row in rows[ends[-1]:]):
        return None
    before = rows[:ends[-1]]
    train = next((_numbers(row) for row in reversed(before) if row.get("kind") == "train"), None)
    evals = next((_numbers(row) for row in reversed(before) if row.get("kind") == "eval"), None)
    recipe = _recipe(run_dir)
    peft = recipe.get("peft") if isinstance(recipe.get("peft"), dict) else {}
    final, plot = run_dir / rundir.FINAL, run_dir / rundir.PLOTS
    return Summary(run_dir, _numbers(rows[ends[-1]]), train, evals, peft.get("method", "none") != "none",
                   _generates(recipe, row), final if _own(final) and (final / rundir.MANIFEST).is_file() else None,
                   plot if plot.is_file() else None, recipe_headline(recipe))


def _own(folder: Path) -> bool:
    """Whether ``folder`` is a real folder of the run, not a link to another run's (which is not this run's model)."""
    return folder.is_dir() and not folder.is_symlink()


def _numbers(row: dict[str, Any]) -> dict[str, Any]:
    """``row``'s values that are numbers (ints and floats, not bools), and its ``kind``: what a summary shows of a
    metrics row. Whatever else a damaged or forged row holds (a string with a line break, a list, an object) is
    left out, so a summary is always its own lines with numbers in them."""
    return {key: value for key, value in row.items()
            if key == "kind" or (isinstance(value, int | float) and not isinstance(value, bool))}


def _real(value: Any) -> bool:
    """Whether ``value`` is a finite, non-negative number: a count or a duration that can be shown."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf


def _duration(seconds: Any) -> str:
    """``26.8 s``, ``4 min 05 s``, ``2 h 03 min``; ``?`` for what is not a finite, non-negative number of seconds."""
    if not _real(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _count(value: Any) -> str:
    """``1,234``; ``?`` for what is not a non-negative whole number."""
    return f"{value:,}" if isinstance(value, int) and _real(value) else "?"


def _led(row: dict[str, Any], lead: tuple[str, ...]) -> dict[str, Any]:
    """``row`` with the keys of ``lead`` that it holds first (in ``lead``'s order), then the others as they were."""
    return {**{key: row[key] for key in lead if key in row}, **row}


def _final_train(key: str, train: dict[str, Any] | None) -> str:
    """``  final train loss: 1.2500 (step 2)``, or ``... none logged`` when the last train row has no number."""
    value = train.get(key) if train else None
    if isinstance(value, int | float):
        return f"  final train {key}: {value:.4f} (step {_count(train.get('step'))})"  # type: ignore[union-attr]
    return f"  final train {key}: none logged"


def _shown(path: Path) -> Path:
    """``path`` relative to the current folder when it lies inside it (``runs/q``), else absolute: the same text
    whether the run itself (which knows its folder as an absolute path) or ``finetune ls runs/q`` prints it."""
    path = path.absolute()
    try:
        return path.relative_to(Path.cwd())
    except (ValueError, OSError):
        return path


def render(summary: Summary) -> list[str]:
    """The summary's lines, as the end of a run prints them and ``finetune ls`` shows them again."""
    end, run = summary.end, _shown(summary.run_dir)
    final, plot = (_shown(p) if p else None for p in (summary.final, summary.plot))
    quoted = shlex.quote(str(run))
    lines = [f"run {run} finished: {_count(end.get('step'))} steps, {_count(end.get('samples'))} samples, "
             f"{_count(end.get('tokens'))} target tokens; training {_duration(end.get('train_s'))}, wall "
             f"{_duration(end.get('wall_s'))}"]
    lines += [_final_train(key, summary.train) for key in summary.headline.train]
    if summary.eval:
        lines.append(f"  final eval (step {_count(summary.eval.get('step'))}):")
        lines += [f"    {line}" for line in format_metrics(_led(summary.eval, summary.headline.eval),
                                                          skip=("step", "kind"))]
    else:
        lines.append("  final eval: none (no data.eval)")
    lines.append(f"  model:   {final}" if final else
                 f"  model:   no {rundir.FINAL}/ (checkpoint.save_final: false); `finetune export {quoted} -o DIR` "
                 "writes one from a checkpoint")
    if plot:
        lines.append(f"  plot:    {plot}")
    lines.append(f"  logs:    {run / rundir.TRAIN_LOG}, {run / rundir.METRICS}")
    if final:
        lines.append("  next:")
        lines.append(f"    finetune eval {quoted}")
        if summary.generates:
            out = shlex.quote(f"{run}-completions.jsonl")
            lines.append(f"    finetune generate {quoted} prompts.jsonl -o {out}")
        if summary.peft:
            lines.append(f"    finetune merge {quoted} -o {shlex.quote(str(run) + '-merged')}")
    return lines
