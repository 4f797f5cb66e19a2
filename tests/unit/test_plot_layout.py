"""The plot's figure keeps its title, its panels and its legend apart, checked with matplotlib's own geometry on the
rendered figure (Agg): the title's and the legend's window extents do not intersect, nor does either meet a panel,
and both lie inside the figure, for one run and for a dozen runs with long names (a legend of several rows). Runs
are made by hand, as in tests/unit/test_plot.py. Nothing here trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from finetune.storage import plot
from tests.unit.test_plot import grpo_run, log_row, make_run

pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def _extents(fig: Any) -> tuple[Bbox, Bbox, list[Bbox], Bbox]:
    """(title, legend, every visible panel with its labels and ticks, figure) in display pixels, after drawing the
    figure as the PNG is drawn."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    named = legend.get_texts()  # a run's name in the legend can be the whole title
    (title,) = [t for t in fig.findobj(Text) if t.get_text() == fig.get_suptitle() and t not in named]
    panels = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.get_visible()]
    return title.get_window_extent(renderer), legend.get_window_extent(renderer), panels, fig.bbox


def _inside(inner: Bbox, outer: Bbox) -> bool:
    return inner.x0 >= outer.x0 and inner.y0 >= outer.y0 and inner.x1 <= outer.x1 and inner.y1 <= outer.y1


def _assert_apart(runs: list[plot.RunMetrics]) -> tuple[Bbox, Bbox]:
    fig = plot.draw(plot.plan_panels(runs), [run.label for run in runs])
    title, legend, panels, figure = _extents(fig)
    assert not title.overlaps(legend), (title, legend)
    for panel in panels:
        assert not panel.overlaps(title) and not panel.overlaps(legend), (panel, title, legend)
    assert _inside(title, figure) and _inside(legend, figure), (title, legend, figure)
    return title, legend


def test_one_run_title_and_legend_are_apart(tmp_path: Path) -> None:
    run = make_run(tmp_path / "runs" / "sft", train_steps=12, eval_every=4)
    title, legend = _assert_apart(plot.load_runs([run]))
    assert legend.y1 < title.y0  # the title above the grid, the legend below it


def test_a_dozen_long_named_runs_keep_a_legend_of_several_rows_apart_from_the_title(tmp_path: Path) -> None:
    runs = [make_run(tmp_path / "runs" / f"a-rather-long-run-name-for-a-sweep-{i:02d}", train_steps=40,
                     eval_every=10, metrics=("exact_match", "token_accuracy")) for i in range(12)]
    loaded = plot.load_runs(runs)
    title, legend = _assert_apart(loaded)
    assert legend.height > 3 * title.height  # several rows: the long legend this checks


def test_a_title_wider_than_a_one_panel_figure_wraps_inside_it(tmp_path: Path) -> None:
    runs = []
    for i in range(5):  # train rows with the lr only: one panel, a figure one panel wide
        run = make_run(tmp_path / "runs" / f"a-really-quite-long-sweep-run-name-{i:02d}", train_steps=0,
                       eval_every=None)
        for step in (1, 2):
            log_row(run, "train", {"step": step, "lr": 0.1 * step})
        runs.append(run)
    loaded = plot.load_runs(runs)
    assert [panel.key for panel in plot.plan_panels(loaded)] == ["lr"]
    title, legend = _assert_apart(loaded)
    assert title.height > 3 * legend.height / 5  # the title takes several lines (the legend: one per run)


def test_grpo_run_with_many_panels_keeps_them_apart(tmp_path: Path) -> None:
    runs = [grpo_run(tmp_path / "runs" / f"grpo-{i}", {"beta": 0.04}, steps=40, eval_every=10,
                     functions=("exact_match", "format")) for i in range(3)]
    _assert_apart(plot.load_runs(runs))


def test_the_check_can_fail() -> None:
    """The same geometry calls find a legend put where the title is."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4, 3), layout="constrained")
    FigureCanvasAgg(fig)
    fig.subplots().plot([0, 1], [0, 1])
    fig.suptitle("a vs b")
    fig.legend(["a"], loc="upper center")
    title, legend, _, _ = _extents(fig)
    assert title.overlaps(legend)
