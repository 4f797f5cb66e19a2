"""``finetune plot`` draws the MFU and peak-memory panels when a run logged them (GPU runs; a CPU run with
``train.peak_tflops`` logs mfu only), and leaves them out when no run did. Runs are made by hand, as in
tests/unit/test_plot.py. Nothing here trains."""

from __future__ import annotations

from pathlib import Path

from finetune.storage import plot, rundir
from tests.unit.test_plot import log_row, summary


def _run(folder: Path, *, mfu: bool, memory: bool) -> Path:
    rundir.create(folder, overwrite=False).release()
    for step in range(1, 4):
        row: dict[str, float | int] = {"step": step, "loss": 2.0 / step, "lr": 1e-3, "grad_norm": 1.0,
                                       "tokens": 64 * step, "elapsed_s": 0.1 * step, "tokens_per_s": 640.0}
        if mfu:
            row.update(flops_per_token=7.2e5, mfu=0.38 + 0.01 * step)
        if memory:
            row.update(mem_alloc_gb=61.2, mem_reserved_gb=70.0 + step)
        log_row(folder, "train", row)
    return folder


def test_mfu_and_memory_panels_follow_the_train_panels(tmp_path: Path) -> None:
    gpu, cpu = _run(tmp_path / "gpu", mfu=True, memory=True), _run(tmp_path / "cpu", mfu=False, memory=False)
    got = summary(gpu, cpu)
    assert list(got) == ["loss", "lr", "grad_norm", "mfu", "mem_alloc_gb", "mem_reserved_gb"]
    assert got["mfu"] == [("gpu", 3)] and got["mem_reserved_gb"] == [("gpu", 3)]  # only the run that logged them
    panels = plot.plan_panels(plot.load_runs([gpu, cpu]))
    figure = plot.draw(panels, ["gpu", "cpu"])
    titles = [ax.get_title() for ax in figure.axes]
    assert "MFU (per device)" in titles and "peak memory allocated" in titles


def test_no_mfu_or_memory_panel_when_no_run_logged_them(tmp_path: Path) -> None:
    assert list(summary(_run(tmp_path / "cpu", mfu=False, memory=False))) == ["loss", "lr", "grad_norm"]
