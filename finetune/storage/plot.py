"""Runs' metrics drawn as one PNG: ``<run>/plots.png`` at the end of every run, and the figure of ``finetune plot``
(finetune.commands.plot, which checks its ``-o`` and ``--smooth``).

One PNG holds a grid of panels against step. What a run's plot draws first is its task's record
(:attr:`finetune.objectives.Objective.panels`, carried by the run's :class:`~finetune.storage.metrics.Headline`):
a GRPO run's total train reward, its eval exact match and eval reward, the reward of each reward function (with two
or more), the mean completion length, the KL to the reference (logged with ``grpo.beta`` > 0), then its loss (only
where its value carries information: ``grpo.iterations`` > 1 or ``grpo.beta`` > 0), lr and gradient norm. Every
other task keeps the default order: train loss, learning rate, gradient norm, MFU and peak memory where logged, then
every eval metric (``eval_loss``, ``eval_ppl``, then ``eval_<metric>`` as logged). A panel no run logged is left
out. Several runs are overlaid, one colour per run, named in one legend below the grid (the figure's title, above
it, can never meet it). Counts (``eval_samples``, ``eval_correct`` / ``eval_total``, ``eval_<metric>_correct`` /
``_total``) and spreads (``reward_std`` beside ``reward``) are not panels.

A dense train curve (more points than :data:`MARKER_POINTS`) is drawn faint with a smoothed line over it, as
TensorBoard draws it (:func:`smooth`, a debiased exponential moving average, weight :data:`SMOOTHING` unless
``--smooth`` says otherwise; 0 turns it off); a sparse curve, every eval curve among them, is drawn as logged, each
point marked. Set values (the learning rate) and peaks (memory) are never smoothed.

The work is split so that what gets drawn is plain data: :func:`load_runs` reads and checks the runs (through
:func:`finetune.storage.metrics.read_metrics`), :func:`plan_panels` decides the panels, their series and their
smoothed lines, and only :func:`draw` / :func:`render` touch matplotlib. matplotlib is imported inside them (the CLI
stays light) and draws on its Agg canvas without pyplot: no window, no global figure state.
"""

from __future__ import annotations

import io
import math
import os
import secrets
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError, RunDirError
from finetune.storage import rundir
from finetune.storage.metrics import LOSS_FIRST, Headline, read_metrics
from finetune.storage.summary import run_headline

# Train panels: key -> (panel title, y-axis label); a train key not here is titled "train <key>", and a key a
# ``prefix*`` pattern matched "train <prefix>: <rest>" (a task's record names patterns, see plan_panels).
TRAIN_TITLES = {"reward": ("train reward (total)", "reward"),  # GRPO: the mean total reward of the step's completions
                "loss": ("train loss", "loss"), "lr": ("learning rate", "lr"),
                "grad_norm": ("gradient norm", "grad_norm"),
                "completion_len": ("completion length (mean)", "tokens"),  # GRPO: generated tokens to the first stop
                "kl": ("KL to the reference (per token)", "kl"),  # GRPO with grpo.beta > 0
                "mfu": ("MFU (per device)", "mfu"), "mem_alloc_gb": ("peak memory allocated", "GB"),
                "mem_reserved_gb": ("peak memory reserved", "GB")}
# The train panels of a run whose task's record names none, and the ones after a record's own, in order (reward:
# a GRPO run whose recipe cannot be read back still shows it).
DEFAULT_TRAIN = ("reward", "loss", "lr", "grad_norm")
# Logged only where known (mfu: a peak FLOPs; memory: CUDA): after the train panels, for every task.
HARDWARE_TRAIN = ("mfu", "mem_alloc_gb", "mem_reserved_gb")
# Eval keys drawn first, in this order; every other eval_* key that is not a count follows in first-logged order.
EVAL_FIRST = ("eval_loss", "eval_ppl")
# Eval keys that are counts, not metrics.
EVAL_COUNTS = frozenset({"eval_samples", "eval_correct", "eval_total"})
COUNT_SUFFIXES = ("_correct", "_total")
# A train key <key>_std beside a logged <key> is that key's spread over the step's samples, not a panel of its own.
SPREAD_SUFFIX = "_std"
PATTERN = "*"  # a panel key ending in it stands for every train key with that prefix (a task record's panels)
PNG_SUFFIX = ".png"
# Panels drawn on a log y axis (a loss spans decades; perplexity is its exponential), said so on the axis label.
LOG_SCALE = frozenset({"loss", "eval_loss", "eval_ppl"})
# A panel whose series have at most this many points marks each point, so a single eval is visible; a denser train
# panel gets a smoothed line over its faint raw one instead.
MARKER_POINTS = 30
# The smoothing weight of a dense train curve: TensorBoard's default, so a curve reads the same here as there. A
# point's share of the smoothed value is 1 - 0.6 = 0.4 and shrinks by 0.6 per later point (under 5 % five points
# on): step-to-step noise evens out while a trend shows within a few points.
SMOOTHING = 0.6
# Train keys never smoothed: set, not measured (the schedule's lr), or running peaks (memory), whose jumps are the
# information.
UNSMOOTHED = frozenset({"lr", "mem_alloc_gb", "mem_reserved_gb"})


@dataclass(frozen=True)
class RunMetrics:
    """One run to plot: its legend label (the folder name), its folder, its metrics.jsonl rows, and what it leads
    with (its recipe's :class:`~finetune.storage.metrics.Headline`)."""

    label: str
    path: Path
    rows: list[dict[str, Any]]
    headline: Headline = LOSS_FIRST


@dataclass(frozen=True)
class Series:
    """One run's line in one panel: finite or NaN values (NaN leaves a gap, e.g. a skipped non-finite step), and
    their smoothed line (:func:`smooth`; None: drawn as logged)."""

    run: str
    steps: tuple[float, ...]
    values: tuple[float, ...]
    smoothed: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Panel:
    """One subplot: the metric key it shows, its title and y label, one series per run that logged it, whether
    its y axis is logarithmic (``log``: loss and perplexity whose values are all positive), and the weight its
    series were smoothed with (``smoothing``; 0: drawn as logged, each point marked)."""

    key: str
    title: str
    ylabel: str
    series: tuple[Series, ...]
    log: bool = False
    smoothing: float = 0.0


def is_eval_metric(key: str) -> bool:
    """Whether an eval row's key is a metric to plot (``eval_loss``, ``eval_exact_match``), not a count."""
    return key.startswith("eval_") and key not in EVAL_COUNTS and not key.endswith(COUNT_SUFFIXES)


LARGEST = 1e100  # beyond this a value is a gap: matplotlib's axis range of +-1.7e308 overflows (internal errors)


def _number(value: Any) -> float | None:
    """A plottable float from a row value: ints and floats (non-finite ones, and ones beyond +-LARGEST, which no
    step, loss or metric reaches, become NaN, a gap); None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        return math.nan
    return number if math.isfinite(number) and abs(number) <= LARGEST else math.nan


def _finite(value: float | None) -> bool:
    """Whether a :func:`_number` result is a real, finite number (a usable step)."""
    return value is not None and not math.isnan(value)


def _kind(row: dict[str, Any]) -> str:
    """``train`` or ``eval``: the row's tag, else guessed from its keys."""
    kind = row.get("kind")
    if isinstance(kind, str):  # train, eval, or a row that is no point on a curve (the run's end row)
        return kind
    return "eval" if any(key.startswith("eval_") for key in row) else "train"


# --- reading and checking the runs ---------------------------------------------------------------------------


def _read_run(path: Path) -> list[dict[str, Any]]:
    """The rows of one run with a numeric step; a RunDirError (one line naming the run) when it cannot be plotted."""
    if not path.exists():
        raise RunDirError(f"{path}: no such folder; give a run directory made by `finetune run` (runs/<name>)")
    if not path.is_dir():
        raise RunDirError(f"{path}: not a run directory (it is a file); give a folder made by `finetune run`")
    if not (path / rundir.MARKER).is_file():
        raise RunDirError(f"{path}: not a finetune run directory (no {rundir.MARKER}); give a folder made by "
                          "`finetune run`")
    if not os.path.lexists(path / rundir.METRICS):  # anything else there (a link, a FIFO) read_metrics refuses
        raise RunDirError(f"{path}: no metrics yet (no {rundir.METRICS}); plot it once it has logged a step "
                          "(see logging.every_steps)")
    try:
        rows = read_metrics(path)
    except OSError as exc:
        raise RunDirError(f"{path / rundir.METRICS}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    rows = [row for row in rows if isinstance(row, dict) and _finite(_number(row.get("step")))]
    if not rows:
        raise RunDirError(f"{path}: no metrics yet ({rundir.METRICS} holds no rows); plot it once it has logged a "
                          "step (see logging.every_steps)")
    return rows


def _labels(paths: Sequence[Path]) -> list[str]:
    """Legend labels: each run's folder name, or the path as given where two runs share a folder name."""
    names = [path.resolve().name or str(path) for path in paths]
    return [name if names.count(name) == 1 else str(path) for name, path in zip(names, paths, strict=True)]


def load_runs(paths: Sequence[Path]) -> list[RunMetrics]:
    """Read every run; every run that cannot be plotted is reported at once, one line each (RunDirError)."""
    problems: list[str] = []
    runs: list[RunMetrics] = []
    seen: dict[Path, Path] = {}
    for path, label in zip(paths, _labels(paths), strict=True):
        resolved = path.resolve()
        if resolved in seen:
            also = f" (also as {seen[resolved]})" if str(seen[resolved]) != str(path) else ""
            problems.append(f"{path}: given twice{also}; give each run once")
            continue
        seen[resolved] = path
        try:
            runs.append(RunMetrics(label, path, _read_run(path), run_headline(path)))
        except FinetuneError as exc:
            problems.extend(str(exc).splitlines())
    if problems:
        raise RunDirError("\n".join(problems))
    return runs


# --- what is drawn --------------------------------------------------------------------------------------------


def _series(run: RunMetrics, kind: str, key: str) -> Series | None:
    """The run's (step, value) points of ``key`` in its ``kind`` rows, sorted by step; None when it has none, or
    for the train loss of a run whose headline leaves it out (a GRPO loss that is ~0 by construction)."""
    if kind == "train" and key == "loss" and not run.headline.loss:
        return None
    points = sorted((float(row["step"]), value) for row in run.rows
                    if _kind(row) == kind and (value := _number(row.get(key))) is not None)
    if not points:
        return None
    steps, values = zip(*points, strict=True)
    return Series(run.label, tuple(steps), tuple(values))


def smooth(values: Sequence[float], weight: float) -> tuple[float, ...]:
    """TensorBoard's smoothing of a curve: a running exponential moving average ``m = weight * m + (1 - weight) *
    value`` from ``m = 0``, divided by ``1 - weight ** t`` (``t``: the values seen so far) to remove the pull toward
    that 0 start, so the first point is the first value and a weight of 0 returns the values. A NaN (a gap) stays a
    gap and is skipped by the average."""
    out: list[float] = []
    mean, seen = 0.0, 0
    for value in values:
        if math.isnan(value):
            out.append(value)
            continue
        seen += 1
        mean = weight * mean + (1 - weight) * value
        out.append(mean / (1 - weight ** seen))
    return tuple(out)


def _eval_keys(runs: Iterable[RunMetrics]) -> list[str]:
    """Every eval metric any run logged: eval_loss and eval_ppl first, then the others in first-logged order."""
    found: dict[str, None] = {}
    for run in runs:
        for row in run.rows:
            if _kind(row) == "eval":
                found.update((key, None) for key, value in row.items()
                             if is_eval_metric(key) and _number(value) is not None)
    return [key for key in EVAL_FIRST if key in found] + [key for key in found if key not in EVAL_FIRST]


def _train_keys(run: RunMetrics) -> list[str]:
    """The run's train-row keys that hold a number, in first-logged order."""
    found: dict[str, None] = {}
    for row in run.rows:
        if _kind(row) == "train":
            found.update((key, None) for key, value in row.items() if _number(value) is not None)
    return list(found)


def _matches(run: RunMetrics, pattern: str) -> list[str]:
    """The run's train keys a ``prefix*`` pattern stands for: those with the prefix that are not a spread of
    another logged key; none unless there are at least two (one reward function's curve is the total's)."""
    keys = _train_keys(run)
    prefix = pattern.removesuffix(PATTERN)
    found = [key for key in keys if key.startswith(prefix) and key != prefix
             and not (key.endswith(SPREAD_SUFFIX) and key.removesuffix(SPREAD_SUFFIX) in keys)]
    return found if len(found) >= 2 else []


def _title(key: str, pattern: str | None) -> tuple[str, str]:
    """(panel title, y label) of a panel: an eval metric's ``eval <name>``; a train key's from
    :data:`TRAIN_TITLES`, else ``train <prefix>: <rest>`` for a key a pattern matched, else ``train <key>``."""
    if key.startswith("eval_"):
        return "eval " + key.removeprefix("eval_"), key
    if key in TRAIN_TITLES:
        return TRAIN_TITLES[key]
    if pattern is not None:
        prefix = pattern.removesuffix(PATTERN)
        return f"train {prefix.rstrip('_')}: {key.removeprefix(prefix)}", key
    return f"train {key}", key


def _wanted(runs: Sequence[RunMetrics]) -> list[tuple[str, str | None, frozenset[str] | None]]:
    """The panels to plan, in order, as (key, the pattern that matched it, the runs it is drawn for; None: every
    run): the runs' own panels (their tasks' records, in run order), then the default train panels, the hardware
    ones and every eval metric; a pattern stands for the keys it matched, for the runs that logged them."""
    order = dict.fromkeys([*(key for run in runs for key in run.headline.panels), *DEFAULT_TRAIN,
                           *HARDWARE_TRAIN, *_eval_keys(runs)])
    wanted: dict[str, tuple[str, str | None, frozenset[str] | None]] = {}
    for item in order:
        if not item.endswith(PATTERN):
            wanted.setdefault(item, (item, None, None))
            continue
        matched: dict[str, set[str]] = {}
        for run in runs:
            for key in _matches(run, item):
                matched.setdefault(key, set()).add(run.label)
        for key, labels in matched.items():
            wanted.setdefault(key, (key, item, frozenset(labels)))
    return list(wanted.values())


def plan_panels(runs: Sequence[RunMetrics], smoothing: float = SMOOTHING) -> list[Panel]:
    """The panels to draw, in order: the runs' own panels (their tasks' records: GRPO's rewards, eval, completion
    length and KL), then reward, loss, lr, grad_norm, mfu and peak memory (allocated, reserved), then each eval
    metric. A panel holds one series per run that logged its key and is left out when no run did (a run without
    eval rows gets train panels only; a run with no reward, no reward panel). A train panel with more than
    :data:`MARKER_POINTS` points in a series, not in :data:`UNSMOOTHED`, has its series smoothed with weight
    ``smoothing`` (:func:`smooth`; 0: none)."""
    panels = []
    for key, pattern, drawn_for in _wanted(runs):
        kind = "eval" if key.startswith("eval_") else "train"
        series = tuple(s for run in runs if (drawn_for is None or run.label in drawn_for)
                       and (s := _series(run, kind, key)) is not None)
        if not series:
            continue
        title, ylabel = _title(key, pattern)
        log = key in LOG_SCALE and all(v > 0 for s in series for v in s.values if not math.isnan(v))
        weight = smoothing if (kind == "train" and key not in UNSMOOTHED
                               and max(len(s.steps) for s in series) > MARKER_POINTS) else 0.0
        if weight > 0:
            series = tuple(replace(s, smoothed=smooth(s.values, weight)) for s in series)
        panels.append(Panel(key, title, f"{ylabel} (log scale)" if log else ylabel, series, log, weight))
    if not panels:
        names = ", ".join(str(run.path) for run in runs)
        raise RunDirError(f"{names}: {rundir.METRICS} holds no loss, lr, grad_norm or eval metric to plot yet")
    return panels


def panel_summary(panels: Iterable[Panel]) -> dict[str, list[tuple[str, int]]]:
    """Panel key -> [(run label, number of points)]: what a plot shows, as data (for tests and messages)."""
    return {panel.key: [(s.run, len(s.steps)) for s in panel.series] for panel in panels}


# Figure geometry (inches): one panel's width and height, and the height of one legend row below the grid.
_PANEL_W, _PANEL_H, _LEGEND_ROW_H = 5.2, 3.4, 0.3
_DPI = 100
# A legend entry's width in pixels per character of its label, plus its line sample and padding (10-point text).
_CHAR_PX, _ENTRY_PX = 6.5, 60


def draw(panels: Sequence[Panel], labels: Sequence[str]) -> Any:
    """A matplotlib Figure (on the Agg canvas) with the panels as a grid: a title and step / metric axis labels on
    each (a log y axis where the panel says so), one colour per run (``labels``, in order; a smoothed series is its
    raw curve faint with the smoothed line over it in the same colour), the run names as the figure's title above
    the grid and one legend below it, naming every run (and, where a panel is smoothed, what faint and solid
    mean). Constrained layout keeps the title, the panels and the legend apart, however many runs there are."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: heavy
    from matplotlib.figure import Figure  # lazy: heavy
    from matplotlib.lines import Line2D  # lazy: heavy
    from matplotlib.ticker import MaxNLocator  # lazy: heavy

    ncols = 1 if len(panels) == 1 else 2 if len(panels) <= 4 else 3
    nrows = math.ceil(len(panels) / ncols)
    colour = dict(zip(labels, _colours(len(labels)), strict=True))
    handles = [Line2D([], [], color=colour[label], linewidth=2) for label in labels]
    names = list(labels)
    smoothing = max(panel.smoothing for panel in panels)
    if smoothing > 0:  # what a faint and a solid line mean, in grey: the same for every run
        handles += [Line2D([], [], color="0.45", linewidth=1.0, alpha=0.3),
                    Line2D([], [], color="0.45", linewidth=1.8)]
        names += ["raw (train)", f"smoothed (EMA weight {smoothing:g})"]
    width = _PANEL_W * ncols
    legend_cols = max(1, min(len(names), int(0.95 * width * _DPI
                                             // (_CHAR_PX * max(map(len, names)) + _ENTRY_PX))))
    legend_rows = math.ceil(len(names) / legend_cols)
    fig = Figure(figsize=(width, _PANEL_H * nrows + 0.5 + _LEGEND_ROW_H * legend_rows), dpi=_DPI,
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    steps = [step for panel in panels for series in panel.series for step in series.steps]
    pad = max(0.5, 0.03 * (max(steps) - min(steps)))  # one step range on every panel: train and eval line up
    for ax, panel in zip(axes, panels, strict=False):
        marker = "o" if panel.smoothing == 0 and max(len(s.steps) for s in panel.series) <= MARKER_POINTS else None
        for series in panel.series:
            if series.smoothed is None:
                ax.plot(series.steps, series.values, color=colour[series.run], marker=marker, markersize=3.5,
                        linewidth=1.4)
            else:
                ax.plot(series.steps, series.values, color=colour[series.run], linewidth=1.0, alpha=0.3)
                ax.plot(series.steps, series.smoothed, color=colour[series.run], linewidth=1.8)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_xlim(min(steps) - pad, max(steps) + pad)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        if panel.log:
            ax.set_yscale("log")
            ax.grid(True, which="minor", alpha=0.1)
        else:  # (a log axis has its own tick formatter)
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(figure_title(labels), wrap=True)
    # below the grid: the title sits above it, so the two cannot meet however many rows the legend takes
    fig.legend(handles, names, loc="outside lower center", ncols=legend_cols, frameon=False)
    return fig


def figure_title(labels: Sequence[str], most: int = 4) -> str:
    """The figure's title: the runs' names (``a vs b``), the first ``most`` and a count beyond them."""
    shown = " vs ".join(labels[:most])
    return shown + (f" (+{len(labels) - most} more)" if len(labels) > most else "")


def render(panels: Sequence[Panel], labels: Sequence[str]) -> bytes:
    """The PNG bytes of :func:`draw`'s figure."""
    fig = draw(panels, labels)
    buffer = io.BytesIO()  # the file is written only once the whole PNG exists
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _colours(count: int) -> list[Any]:
    """``count`` distinct colours: matplotlib's tab10 (then tab20) palette, evenly spaced turbo beyond 20 runs."""
    from matplotlib import colormaps  # lazy: heavy

    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    if count <= 20:
        return [colormaps["tab20"](i) for i in range(count)]
    return [colormaps["turbo"](i / (count - 1)) for i in range(count)]


# --- writing ------------------------------------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """Write ``data`` to ``tmp`` (default: a fresh hidden file beside ``path``), then rename it onto ``path``, so
    ``path`` is never half written and nothing is left behind on failure; never through a link
    (:func:`finetune.storage.rundir.write_bytes_atomic`)."""
    if tmp is None:  # a fresh random name (O_EXCL there: never someone else's file); a killed plot's is removed
        rundir.clear_stale_scratch(path)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{rundir.TMP}")
    rundir.write_bytes_atomic(path, data, tmp)


def write_run_plot(run_dir: Path, log: Callable[[dict[str, str]], None] | None = None) -> Path | None:
    """Write ``<run_dir>/plots.png`` at the end of a run (rank 0) and return its path, or None when it failed.

    Never raises an Exception: a run whose model is exported must not fail over a plot, so a failure is one warning
    line. ``log`` takes info rows as the run's tracker does (``{"message": ...}``, plus ``"level": "warning"`` for a
    failure, which the tracker shows on stderr and keeps in train.log); without ``log``, or when ``log`` itself
    fails, the warning is printed to stderr here.
    """
    path = run_dir / rundir.PLOTS
    try:
        runs = load_runs([run_dir])
        write_atomic(path, render(plan_panels(runs), [runs[0].label]), run_dir / (rundir.PLOTS + rundir.TMP))
    except Exception as exc:  # any failure, matplotlib's included, is a warning: the run itself is complete
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        what = detail if isinstance(exc, FinetuneError) else f"{type(exc).__name__}: {detail}"
        warning = f"warning: could not write {path} ({what}); the run itself is complete"
        if not _logged(log, {"level": "warning", "message": warning}):
            print(warning, file=sys.stderr)
        return None
    _logged(log, {"message": f"plotted {path}"})
    return path


def _logged(log: Callable[[dict[str, str]], None] | None, row: dict[str, str]) -> bool:
    """Hand ``row`` to ``log``; False when there is none or it failed (a plot's message never fails a run)."""
    if log is None:
        return False
    try:
        log(row)
    except Exception:  # the tracker's own failure surfaces when the run closes it; here the caller prints instead
        return False
    return True
