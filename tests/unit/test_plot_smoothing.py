"""A dense train curve gets a smoothed line over its faint raw one, as TensorBoard draws it: a debiased exponential
moving average (checked against the formula written out here), with ``finetune plot --smooth W`` (0: off; a weight
outside [0, 1) is one line, exit 2). Sparse curves, eval curves and the learning rate are drawn as logged. Runs are
made by hand, as in tests/unit/test_plot.py. Nothing here trains."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from finetune.commands import plot as plot_command
from finetune.storage import plot
from tests.cli_helpers import assert_user_error, main_exit
from tests.unit.test_plot import log_row, make_run

pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def debiased_ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing, written out: m_0 = 0, m_t = w * m_(t-1) + (1 - w) * x_t, shown as m_t / (1 - w^t)
    (t counts the finite values; a NaN is a gap)."""
    shown, m, t = [], 0.0, 0
    for x in values:
        if math.isnan(x):
            shown.append(math.nan)
            continue
        t += 1
        m = weight * m + (1 - weight) * x
        shown.append(m / (1 - weight ** t))
    return shown


def test_smooth_is_the_debiased_moving_average() -> None:
    values = [4.0, 1.0, 3.0, math.nan, 8.0, 2.0]
    got = plot.smooth(values, 0.6)
    want = debiased_ema(values, 0.6)
    assert got[0] == 4.0  # the first point is the first value: no pull toward the 0 start
    assert got[1] == pytest.approx((0.6 * 0.4 * 4.0 + 0.4 * 1.0) / (1 - 0.36))  # (0.96 + 0.4) / 0.64 = 2.125
    assert got[1] == pytest.approx(2.125)
    assert math.isnan(got[3]) and got[4] == pytest.approx(want[4])
    assert [g for g in got if not math.isnan(g)] == pytest.approx([w for w in want if not math.isnan(w)])
    assert plot.smooth(values[:3], 0.0) == tuple(values[:3])  # weight 0: the values themselves
    constant = plot.smooth([5.0] * 20, 0.9)
    assert constant == pytest.approx((5.0,) * 20)  # a flat curve stays flat from its first point


def test_dense_train_curves_are_smoothed_sparse_and_eval_curves_are_not(tmp_path: Path) -> None:
    dense = make_run(tmp_path / "runs" / "dense", train_steps=plot.MARKER_POINTS + 10, eval_every=5)
    sparse = make_run(tmp_path / "runs" / "sparse", train_steps=plot.MARKER_POINTS, eval_every=5)
    panels = {p.key: p for p in plot.plan_panels(plot.load_runs([dense, sparse]))}
    for key in ("loss", "grad_norm"):  # smoothed per panel: both runs' lines, the sparse one's too
        assert panels[key].smoothing == plot.SMOOTHING
        for series in panels[key].series:
            assert series.smoothed == pytest.approx(tuple(debiased_ema(list(series.values), plot.SMOOTHING)))
    assert panels["lr"].smoothing == 0 and all(s.smoothed is None for s in panels["lr"].series)  # a schedule
    for key in ("eval_loss", "eval_exact_match"):
        assert panels[key].smoothing == 0 and all(s.smoothed is None for s in panels[key].series)
    alone = {p.key: p for p in plot.plan_panels(plot.load_runs([sparse]))}
    assert all(p.smoothing == 0 for p in alone.values())  # at most MARKER_POINTS points: drawn as logged
    off = plot.plan_panels(plot.load_runs([dense]), smoothing=0.0)
    assert all(p.smoothing == 0 and all(s.smoothed is None for s in p.series) for p in off)


def test_a_smoothed_panel_draws_the_raw_curve_faint_under_the_smoothed_line(tmp_path: Path) -> None:
    run = make_run(tmp_path / "runs" / "dense", train_steps=50, eval_every=25, nonfinite_at=7)
    panels = plot.plan_panels(plot.load_runs([run]), smoothing=0.8)
    fig = plot.draw(panels, ["dense"])
    axes = {panel.key: ax for panel, ax in zip(panels, fig.axes, strict=False)}
    raw, smoothed = axes["loss"].get_lines()
    assert list(raw.get_ydata())[:6] == pytest.approx(list(panels[0].series[0].values)[:6])
    assert list(smoothed.get_ydata())[:6] == pytest.approx(debiased_ema(list(panels[0].series[0].values), 0.8)[:6])
    assert (raw.get_alpha() or 1.0) < 0.5 and smoothed.get_alpha() in (None, 1.0)
    assert raw.get_color() == smoothed.get_color()  # one colour per run
    assert smoothed.get_linewidth() > raw.get_linewidth()
    assert len(axes["eval_loss"].get_lines()) == 1  # eval: as logged, points marked
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["dense", "raw (train)", "smoothed (EMA weight 0.8)"]
    assert plot.render(panels, ["dense"]).startswith(b"\x89PNG")


def test_smooth_option_sets_the_weight_and_zero_turns_it_off(tmp_path, monkeypatch, capsys) -> None:
    run = make_run(tmp_path / "runs" / "dense", train_steps=40, eval_every=None)
    log_row(run, "train", {"step": 41, "loss": 0.5, "lr": 1e-3, "grad_norm": 0.1})
    for weight in ("0", "0.9"):
        code, out, err = main_exit(monkeypatch, capsys, "plot", str(run), "-o", f"w{weight}.png", "--smooth", weight)
        assert code == 0, err
        assert out.startswith(f"wrote w{weight}.png: 3 panels")
    drawn: list[float] = []

    def plan(runs: list[plot.RunMetrics], smoothing: float) -> list[plot.Panel]:
        drawn.append(smoothing)
        return plot.plan_panels(runs, smoothing)

    monkeypatch.setattr(plot_command, "plan_panels", plan)
    for args, weight in (([], plot.SMOOTHING), (["--smooth", "0"], 0.0), (["--smooth", "0.9"], 0.9)):
        assert main_exit(monkeypatch, capsys, "plot", str(run), "-o", "p.png", "--overwrite", *args)[0] == 0
        assert drawn.pop() == weight


@pytest.mark.parametrize("weight", ["1", "1.5", "-0.1", "nan", "inf"])
def test_a_smoothing_weight_outside_zero_to_one_is_one_line_exit_2(tmp_path, monkeypatch, capsys,
                                                                   weight: str) -> None:
    run = make_run(tmp_path / "runs" / "r", train_steps=3, eval_every=None)
    code, out, err = main_exit(monkeypatch, capsys, "plot", str(run), "--smooth", weight)
    (line,) = assert_user_error(code, out, err, "--smooth", "from 0", "not including, 1")
    assert not (tmp_path / "plot.png").exists(), line
