"""``finetune plot`` and ``finetune.storage.plot``: which panels and series a plot holds, the PNG it writes, and the
user mistakes (one line, exit 2, nothing written). Runs are made by hand: a run dir created as ``finetune run`` does,
with metrics.jsonl rows written as the tracker writes them. Nothing here trains."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.storage import plot, rundir
from tests.cli_helpers import assert_user_error, main_exit
from tests.recipe_files import write_recipe_file

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TRAIN_KEYS = ["loss", "lr", "grad_norm"]


pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def make_run(folder: Path, *, train_steps: int, eval_every: int | None, metrics: tuple[str, ...] = ("exact_match",),
             nonfinite_at: int | None = None) -> Path:
    """A finetune run dir (marker + lock, as `finetune run` creates it) whose metrics.jsonl holds a train row per
    step and, every ``eval_every`` steps, an eval row shaped like loop.evaluate's: loss, ppl, samples, and each
    metric with its _correct/_total counts (plus eval_correct/eval_total of the first)."""
    rundir.create(folder, overwrite=False).release()
    for step in range(1, train_steps + 1):
        loss = math.inf if step == nonfinite_at else 3.0 / math.sqrt(step)
        log_row(folder, "train", {"step": step, "loss": loss, "lr": 1e-3 * min(1.0, step / 3),
                                  "grad_norm": 1.0 / step, "tokens": 64 * step, "elapsed_s": 0.1 * step})
        if eval_every and step % eval_every == 0:
            row: dict[str, float | int] = {"step": step, "eval_loss": 2.0 / step, "eval_ppl": math.exp(2.0 / step),
                                           "eval_samples": 40}
            for index, name in enumerate(metrics):
                correct = min(40, 4 * step + index)
                row.update({f"eval_{name}": correct / 40, f"eval_{name}_correct": correct, f"eval_{name}_total": 40})
            row["eval_correct"], row["eval_total"] = row[f"eval_{metrics[0]}_correct"], 40
            log_row(folder, "eval", row)
    return folder


def log_row(run: Path, kind: str, row: dict[str, float | int]) -> None:
    """Append one row to the run's metrics.jsonl as the tracker writes it: a JSON object tagged with its ``kind``
    (Infinity / NaN as Python's json writes them), read back by finetune.storage.metrics.read_metrics."""
    with (run / rundir.METRICS).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"kind": kind, **row}) + "\n")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, data[:16]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def summary(*runs: Path) -> dict[str, list[tuple[str, int]]]:
    return plot.panel_summary(plot.plan_panels(plot.load_runs(list(runs))))


# --- what is plotted ----------------------------------------------------------------------------------------------


def test_two_runs_are_overlaid_in_every_panel_and_counts_are_not_plotted(tmp_path, monkeypatch, capsys) -> None:
    a = make_run(tmp_path / "runs" / "alpha", train_steps=12, eval_every=4, metrics=("exact_match", "token_accuracy"))
    b = make_run(tmp_path / "runs" / "beta", train_steps=7, eval_every=3, metrics=("exact_match", "token_accuracy"))
    code, out, err = main_exit(monkeypatch, capsys, "plot", str(a), str(b), "-o", "cmp.png")
    assert code == 0, err
    assert "cmp.png" in out and err == ""
    width, height = png_size(tmp_path / "cmp.png")
    assert (tmp_path / "cmp.png").stat().st_size > 20_000 and width > 500 and height > 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.png", "runs"]  # no temporary file left behind

    planned = summary(a, b)
    assert list(planned) == [*TRAIN_KEYS, "eval_loss", "eval_ppl", "eval_exact_match", "eval_token_accuracy"]
    for key in TRAIN_KEYS:
        assert planned[key] == [("alpha", 12), ("beta", 7)], key
    for key in ("eval_loss", "eval_ppl", "eval_exact_match", "eval_token_accuracy"):
        assert planned[key] == [("alpha", 12 // 4), ("beta", 7 // 3)], key
    assert not [key for key in planned if key.endswith(("_correct", "_total")) or key == "eval_samples"]
    assert [line for line in out.splitlines() if "panels" in line] == [
        f"wrote cmp.png: {len(planned)} panels ({', '.join(planned)}) for 2 run(s)"]


def grpo_run(folder: Path, grpo: dict[str, float | int], steps: int = 6, eval_every: int = 3,
             functions: tuple[str, ...] = ("exact_match",)) -> Path:
    """A GRPO run dir: its resolved recipe (task grpo, the given grpo keys) and metrics.jsonl rows shaped like a GRPO
    run's (train: loss ~0, the total reward and each reward function's with their spreads, completion length, the
    KL with grpo.beta > 0; eval: samples, exact match with counts, mean reward, no loss)."""
    rundir.create(folder, overwrite=False).release()
    write_recipe_file(folder / rundir.RESOLVED, {"model": {"type": "tiny-llama"}, "task": "grpo", "grpo": grpo})
    for step in range(1, steps + 1):
        row: dict[str, float | int] = {"step": step, "loss": 1e-9 * (-1) ** step, "lr": 2e-4, "grad_norm": 0.5}
        for name in functions:
            row |= {f"reward_{name}": 0.05 * step, f"reward_{name}_std": 0.2}
        row |= {"reward": 0.1 * step, "reward_std": 0.3, "frac_zero_std": 0.25, "completion_len": 5.0 + step,
                "completion_len_max": 12.0, "truncated": 0.0, "clip_fraction": 0.0}
        if grpo.get("beta", 0.0):
            row["kl"] = 0.01 * step
        log_row(folder, "train", row)
        if step % eval_every == 0:
            log_row(folder, "eval", {"step": step, "eval_samples": 40, "eval_exact_match": step / 40,
                                     "eval_exact_match_correct": step, "eval_exact_match_total": 40,
                                     "eval_correct": step, "eval_total": 40, "eval_reward": step / 40})
    return folder


def test_a_grpo_plot_shows_rewards_completion_length_and_kl_and_leaves_out_a_loss_that_carries_nothing(
        tmp_path) -> None:
    """GRPO (its record's panels): the total train reward, the eval exact match and eval reward, each reward
    function's reward where there are two or more (one is the total's curve), the completion length, the KL where
    grpo.beta > 0 logged it, then the loss (only where its value carries information: grpo.iterations > 1 or
    grpo.beta > 0), lr and grad norm. Spreads (``_std``), the zero-std fraction, the clip fraction are no panels.
    Overlaid on an SFT run, the loss panel holds the SFT run's loss and not the GRPO run's ~0."""
    plain = grpo_run(tmp_path / "runs" / "grpo", {"iterations": 1, "beta": 0.0})
    assert summary(plain) == {"reward": [("grpo", 6)], "eval_exact_match": [("grpo", 2)],
                              "eval_reward": [("grpo", 2)], "completion_len": [("grpo", 6)], "lr": [("grpo", 6)],
                              "grad_norm": [("grpo", 6)]}
    assert list(summary(plain)) == ["reward", "eval_exact_match", "eval_reward", "completion_len", "lr", "grad_norm"]
    kl = grpo_run(tmp_path / "runs" / "kl", {"beta": 0.05}, functions=("exact_match", "format"))
    assert list(summary(kl)) == ["reward", "eval_exact_match", "eval_reward", "reward_exact_match", "reward_format",
                                 "completion_len", "kl", "loss", "lr", "grad_norm"]
    titles = {panel.key: panel.title for panel in plot.plan_panels(plot.load_runs([kl]))}
    assert titles["reward"] == "train reward (total)" and titles["reward_format"] == "train reward: format"
    assert titles["kl"] == "KL to the reference (per token)" and titles["completion_len"] == "completion length (mean)"
    sft = make_run(tmp_path / "runs" / "sft", train_steps=4, eval_every=2)
    both = summary(plain, sft)
    assert both["loss"] == [("sft", 4)] and both["reward"] == [("grpo", 6)]
    assert both["eval_exact_match"] == [("grpo", 2), ("sft", 2)]
    # a run with two reward functions beside one with one: only the first has per-function panels
    mixed = summary(plain, kl)
    assert mixed["reward_format"] == [("kl", 6)] and mixed["reward_exact_match"] == [("kl", 6)]
    assert mixed["kl"] == [("kl", 6)] and mixed["loss"] == [("kl", 6)]
    assert list(summary(sft)) == [*TRAIN_KEYS, "eval_loss", "eval_ppl", "eval_exact_match"]  # as before GRPO


def test_the_grpo_records_panels_name_metrics_a_grpo_run_logs() -> None:
    """Every train key GRPO's record plots is one its step metrics hold (read from the task's own functions that
    build a train row), and its ``reward_*`` pattern matches one key per reward function."""
    import torch  # the task module needs it; the plot never imports it

    from finetune import objectives
    from finetune.tasks import grpo

    sums = {"reward": torch.tensor([3.0, 5.0, 6.0]), "reward_squared": torch.tensor([3.0, 5.0, 9.0]),
            "completions": torch.tensor([8.0]), "zero_std_groups": torch.tensor([1.0]), "groups": torch.tensor([2.0]),
            "completion_tokens": torch.tensor([40.0]), "truncated": torch.tensor([1.0]),
            "length_histogram": torch.tensor([0.0, 2.0, 6.0]), "clipped": torch.tensor(0.0),
            "kl": torch.tensor(1.0), "tokens": torch.tensor(40.0)}
    row = grpo.generation_metrics(sums, ["exact_match", "format"]) | grpo.loss_metrics(sums, with_kl=True)
    row |= {"step": 1, "loss": 0.0, "lr": 1e-4, "grad_norm": 1.0}  # every task's (the loop's)
    panels = objectives.OBJECTIVES["grpo"].panels
    assert panels is not None
    for key in panels:
        if key.endswith(plot.PATTERN):
            assert [k for k in row if k.startswith(key[:-1]) and not k.endswith("_std")] == [
                "reward_exact_match", "reward_format"]
        elif not key.startswith("eval_"):
            assert key in row, key


def test_series_hold_the_logged_values_sorted_by_step_and_nonfinite_ones_are_gaps(tmp_path) -> None:
    run = make_run(tmp_path / "r", train_steps=6, eval_every=2, nonfinite_at=4)
    log_row(run, "train", {"step": 0, "loss": 9.0, "lr": 0.0, "grad_norm": 0.0})  # a row logged out of step order
    panels = {panel.key: panel for panel in plot.plan_panels(plot.load_runs([run]))}
    (loss,) = panels["loss"].series
    assert loss.steps == (0, 1, 2, 3, 4, 5, 6) and loss.values[0] == 9.0
    assert math.isnan(loss.values[4]) and loss.values[5] == pytest.approx(3.0 / math.sqrt(5))
    (match,) = panels["eval_exact_match"].series
    assert match.steps == (2, 4, 6) and match.values == pytest.approx((8 / 40, 16 / 40, 24 / 40))
    assert plot.render(list(panels.values()), ["r"]).startswith(PNG_SIGNATURE)  # a gap does not break drawing


def test_figure_is_a_titled_labelled_grid_with_one_legend_entry_per_run(tmp_path) -> None:
    a = make_run(tmp_path / "x" / "same", train_steps=5, eval_every=5)
    b = make_run(tmp_path / "y" / "same", train_steps=5, eval_every=None)  # same folder name: labelled by path
    c = make_run(tmp_path / "third", train_steps=5, eval_every=5)
    runs = plot.load_runs([a, b, c])
    assert [run.label for run in runs] == [str(a), str(b), "third"]
    panels = plot.plan_panels(runs)
    fig = plot.draw(panels, [run.label for run in runs])
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == [panel.title for panel in panels]
    assert all(ax.get_xlabel() == "step" and ax.get_ylabel() for ax in visible)
    assert len({round(ax.get_position().x0, 3) for ax in visible}) > 1  # a grid, not one column of panels
    (legend,) = fig.legends
    assert [text.get_text() for text in legend.get_texts()] == [str(a), str(b), "third"]
    colours = {line.get_color() for ax in visible for line in ax.get_lines()}
    assert len(colours) == 3  # one colour per run, the same in every panel
    eval_ax = visible[[panel.key for panel in panels].index("eval_exact_match")]
    assert len(eval_ax.get_lines()) == 2  # the run without eval rows is absent from eval panels only


def test_loss_and_perplexity_are_on_a_log_axis_that_says_so_and_the_figure_names_the_runs(tmp_path) -> None:
    """Loss, eval loss and perplexity span decades: a log y axis, labelled ``(log scale)``; lr and the metrics
    stay linear; a panel with a value <= 0 stays linear. The figure's title names the runs; the run's end row
    (kind ``end``) is no point on any curve."""
    a = make_run(tmp_path / "runs" / "alpha", train_steps=6, eval_every=2)
    b = make_run(tmp_path / "runs" / "beta", train_steps=6, eval_every=3)
    log_row(a, "end", {"step": 6, "loss": 123.0, "samples": 48, "tokens": 384, "train_s": 0.6, "wall_s": 1.0})
    panels = plot.plan_panels(plot.load_runs([a, b]))
    assert plot.panel_summary(panels)["loss"] == [("alpha", 6), ("beta", 6)]
    fig = plot.draw(panels, ["alpha", "beta"])
    axes = {panel.key: ax for panel, ax in zip(panels, fig.axes, strict=False)}
    for key in ("loss", "eval_loss", "eval_ppl"):
        assert axes[key].get_yscale() == "log" and axes[key].get_ylabel().endswith("(log scale)"), key
    for key in ("lr", "grad_norm", "eval_exact_match"):
        assert axes[key].get_yscale() == "linear" and "log" not in axes[key].get_ylabel(), key
    assert fig.get_suptitle() == "alpha vs beta"
    assert plot.render(panels, ["alpha", "beta"]).startswith(PNG_SIGNATURE)
    log_row(b, "train", {"step": 7, "loss": 0.0, "lr": 1e-3, "grad_norm": 0.1})
    (loss,) = [p for p in plot.plan_panels(plot.load_runs([a, b])) if p.key == "loss"]
    assert not loss.log and loss.ylabel == "loss"
    assert plot.figure_title([f"r{i}" for i in range(6)]) == "r0 vs r1 vs r2 vs r3 (+2 more)"


def test_run_with_train_rows_only_plots_train_panels(tmp_path, monkeypatch, capsys) -> None:
    run = make_run(tmp_path / "runs" / "noeval", train_steps=9, eval_every=None)
    code, out, err = main_exit(monkeypatch, capsys, "plot", str(run))
    assert code == 0, err
    assert out.startswith("wrote plot.png: 3 panels")
    png_size(tmp_path / "plot.png")  # the default -o, in the current folder
    assert summary(run) == {key: [("noeval", 9)] for key in TRAIN_KEYS}


def test_overwrite_replaces_the_output_and_r_plots_png_is_allowed(tmp_path, monkeypatch, capsys) -> None:
    run = make_run(tmp_path / "runs" / "a", train_steps=4, eval_every=2)
    out_file = tmp_path / "plot.png"
    out_file.write_bytes(b"old")
    assert main_exit(monkeypatch, capsys, "plot", str(run), "--overwrite")[0] == 0
    png_size(out_file)
    code, _, err = main_exit(monkeypatch, capsys, "plot", str(run), "-o", str(run / rundir.PLOTS))
    assert code == 0, err
    png_size(run / rundir.PLOTS)
    assert rundir.foreign_entries(run) == []  # plots.png is one of finetune's own run-dir files
    rundir.create(run, overwrite=True).release()  # so --overwrite of the run removes it, refusing nothing
    assert not (run / rundir.PLOTS).exists()


# --- mistakes -------------------------------------------------------------------------------------------------


def _not_a_run(tmp: Path) -> list[str]:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "todo.md").write_text("mine")
    return ["notes"]


def _no_metrics(tmp: Path) -> list[str]:
    rundir.create(tmp / "fresh", overwrite=False).release()
    return ["fresh"]


def _empty_metrics(tmp: Path) -> list[str]:
    rundir.create(tmp / "fresh", overwrite=False).release()
    (tmp / "fresh" / rundir.METRICS).write_text("\n")
    return ["fresh"]


def _deep_row(tmp: Path) -> list[str]:
    make_run(tmp / "ok", train_steps=3, eval_every=None)
    rows = (tmp / "ok" / rundir.METRICS).read_text()
    (tmp / "ok" / rundir.METRICS).write_text(rows + '{"kind": "end", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
                                             + rows)
    return ["ok"]


def _fifo_metrics(tmp: Path) -> list[str]:
    rundir.create(tmp / "fifo", overwrite=False).release()
    os.mkfifo(tmp / "fifo" / rundir.METRICS)
    return ["fifo"]


def _linked_metrics(tmp: Path) -> list[str]:
    make_run(tmp / "other", train_steps=3, eval_every=None)
    rundir.create(tmp / "linked", overwrite=False).release()
    (tmp / "linked" / rundir.METRICS).symlink_to(tmp / "other" / rundir.METRICS)
    return ["linked"]


def _existing_output(tmp: Path) -> list[str]:
    make_run(tmp / "ok", train_steps=3, eval_every=None)
    (tmp / "plot.png").write_bytes(b"keep me")
    return ["ok"]


def _bad_suffix(tmp: Path) -> list[str]:
    make_run(tmp / "ok", train_steps=3, eval_every=None)
    return ["ok", "-o", "plot.jpg"]


def _inside_a_run(tmp: Path) -> list[str]:
    make_run(tmp / "ok", train_steps=3, eval_every=None)
    return ["ok", "-o", "ok/mine.png"]


def _twice(tmp: Path) -> list[str]:
    make_run(tmp / "ok", train_steps=3, eval_every=None)
    return ["ok", "ok"]


@pytest.mark.parametrize(("setup", "needles"), [
    (lambda tmp: ["missing"], ["missing: no such folder"]),
    (_not_a_run, ["notes: not a finetune run directory", rundir.MARKER]),
    (_no_metrics, ["fresh: no metrics yet", rundir.METRICS]),
    (_empty_metrics, ["fresh: no metrics yet"]),
    (_deep_row, ["ok/metrics.jsonl:4: not a JSON object (nested too deep)"]),
    (_fifo_metrics, ["fifo/metrics.jsonl: not a regular file (a FIFO"]),
    (_linked_metrics, ["linked/metrics.jsonl: not a regular file (a symbolic link)"]),
    (_existing_output, ["plot.png already exists", "--overwrite"]),
    (_bad_suffix, ["plot.jpg", ".png"]),
    (_inside_a_run, ["ok/mine.png lies inside the run", rundir.PLOTS]),
    (_twice, ["ok: given twice"]),
], ids=["no-such-dir", "not-a-run", "no-metrics", "empty-metrics", "row-nested-100000-deep", "fifo-metrics",
        "linked-metrics", "existing-output", "bad-suffix", "inside-run", "twice"])
def test_mistakes_are_one_line_exit_2_and_write_nothing(tmp_path, monkeypatch, capsys, setup, needles) -> None:
    args = setup(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, out, err = main_exit(monkeypatch, capsys, "plot", *args)
    assert len(assert_user_error(code, out, err, *needles)) == 1, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_several_mistakes_are_reported_at_once(tmp_path, monkeypatch, capsys) -> None:
    _not_a_run(tmp_path)
    code, out, err = main_exit(monkeypatch, capsys, "plot", "missing", "notes", "-o", "p.svg")
    lines = assert_user_error(code, out, err, "missing", "notes", "p.svg")
    assert len(lines) == 3


# --- at the end of a run, and import cost ---------------------------------------------------------------------


def test_write_run_plot_writes_plots_png_and_logs_it(tmp_path, capsys) -> None:
    run = make_run(tmp_path / "r", train_steps=5, eval_every=5)
    logged: list[dict[str, str]] = []
    assert plot.write_run_plot(run, log=logged.append) == run / rundir.PLOTS
    png_size(run / rundir.PLOTS)
    assert logged == [{"message": f"plotted {run / rundir.PLOTS}"}] and capsys.readouterr().err == ""


def test_write_run_plot_failure_is_one_warning_line_and_never_raises(tmp_path, monkeypatch, capsys) -> None:
    run = make_run(tmp_path / "r", train_steps=5, eval_every=5)

    def broken(*_args: object) -> bytes:
        raise RuntimeError("no backend")

    monkeypatch.setattr(plot, "render", broken)
    logged: list[dict[str, str]] = []
    assert plot.write_run_plot(run, log=logged.append) is None  # to the tracker only: it shows warnings on stderr
    assert capsys.readouterr().err == ""
    (row,) = logged
    assert row["level"] == "warning" and row["message"].startswith(f"warning: could not write {run / rundir.PLOTS}")
    assert "no backend" in row["message"] and "\n" not in row["message"]

    def broken_log(_row: dict[str, str]) -> None:
        raise OSError("log gone")

    for log in (None, broken_log):  # no tracker, or a broken one: the one warning line is printed here
        assert plot.write_run_plot(run, log=log) is None
        assert capsys.readouterr().err.splitlines() == [row["message"]]
    assert sorted(p.name for p in run.iterdir()) == sorted([rundir.MARKER, rundir.LOCK, rundir.METRICS])


def test_importing_the_cli_and_plot_module_loads_no_matplotlib(tmp_path) -> None:
    code = ("import sys, finetune.cli, finetune.storage.plot; "
            "print(sorted(m for m in sys.modules if 'matplotlib' in m))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
