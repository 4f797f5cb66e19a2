"""``finetune plot RUN [RUN ...] -o FILE [--smooth W]``: several runs' metrics overlaid in one PNG.

The figure is :mod:`finetune.storage.plot`'s (the same one every run writes to ``plots.png``); this verb checks the
output path (a PNG, outside any run but that run's own ``plots.png``, never replaced without ``--overwrite``), the
smoothing weight (``--smooth``: 0 up to, not including, 1) and every run, all problems at once, before anything is
drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from finetune.errors import FinetuneError, RunDirError
from finetune.storage import rundir
from finetune.storage.plot import PNG_SUFFIX, SMOOTHING, Panel, load_runs, plan_panels, render, write_atomic


def _output_problem(output: Path, overwrite: bool) -> str | None:
    """Why ``-o output`` cannot be written (one line naming it and the fix), or None."""
    if output.suffix.lower() != PNG_SUFFIX:
        return f"-o {output}: the plot is a PNG; give a file name ending in {PNG_SUFFIX} (e.g. -o plot.png)"
    if output.is_dir():
        return f"-o {output} is a folder; give a file name ending in {PNG_SUFFIX}"
    run = rundir.enclosing_run(output.parent)
    if run is not None and output.resolve() != run / rundir.PLOTS:
        return (f"-o {output} lies inside the run {run}, which holds only what finetune writes; write the plot "
                f"elsewhere, or to {run / rundir.PLOTS}")
    if (output.exists() or output.is_symlink()) and not overwrite:
        return f"-o {output} already exists; pass --overwrite to replace it, or choose another -o"
    try:
        rundir.check_write_target(output)
    except RunDirError as exc:
        return str(exc)
    return None


def _smoothing_problem(smoothing: float) -> str | None:
    """Why ``--smooth`` cannot be used (one line with the range and the default), or None."""
    if math.isfinite(smoothing) and 0 <= smoothing < 1:
        return None
    return (f"--smooth {smoothing:g}: give a weight from 0 (no smoothing) up to, not including, 1 (the default, "
            f"{SMOOTHING:g}, is TensorBoard's)")


def plot_runs(paths: Sequence[Path], output: Path, *, overwrite: bool = False,
              smoothing: float = SMOOTHING) -> list[Panel]:
    """``finetune plot``: check ``-o``, ``smoothing`` and every run (all problems at once), draw them overlaid into
    ``output`` (replacing an existing file only with ``overwrite``; dense train curves smoothed with weight
    ``smoothing``, 0: none), and return the panels drawn."""
    problems = [p for p in (_output_problem(output, overwrite), _smoothing_problem(smoothing)) if p]
    try:
        runs = load_runs(paths)
    except RunDirError as exc:
        raise RunDirError("\n".join([*problems, str(exc)])) from None
    if problems:
        raise FinetuneError("\n".join(problems))
    panels = plan_panels(runs, smoothing)
    data = render(panels, [run.label for run in runs])
    output.parent.mkdir(parents=True, exist_ok=True)
    run = rundir.enclosing_run(output.parent)
    write_atomic(output, data, output.with_name(rundir.PLOTS + rundir.TMP) if run is not None else None)
    return panels
