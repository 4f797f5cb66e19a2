"""A real tiny training run (through `finetune run`, in this process) ends by writing ``<run>/plots.png``, and a
plot that fails is one warning line: the run still exits 0 with its exported model."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.storage import plot, rundir
from tests.integration.conftest import cli_exit_code, recipe_file

SHORT = {"train": {"max_steps": 3}, "eval": {"every_steps": 2, "metrics": ["token_accuracy"]}}


def test_training_run_writes_plots_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_exit_code("run", str(recipe_file(tmp_path, "plotted", **SHORT))) == 0
    run = tmp_path / "plotted"
    data = (run / rundir.PLOTS).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000
    assert rundir.foreign_entries(run) == []
    assert not (run / (rundir.PLOTS + rundir.TMP)).exists()
    assert f"plotted {run / rundir.PLOTS}" in (run / rundir.TRAIN_LOG).read_text()
    planned = plot.panel_summary(plot.plan_panels(plot.load_runs([run])))
    assert planned["loss"] == [("plotted", 3)]  # logging.every_steps=1
    assert planned["eval_token_accuracy"] == [("plotted", 2)]  # step 2 and the last step
    assert "warning" not in capsys.readouterr().err


def test_failed_plot_is_a_warning_and_the_run_still_succeeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    def broken(*_args: object) -> bytes:
        raise RuntimeError("cannot draw here")

    monkeypatch.setattr(plot, "render", broken)
    capsys.readouterr()
    assert cli_exit_code("run", str(recipe_file(tmp_path, "unplotted", **SHORT))) == 0
    run = tmp_path / "unplotted"
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cannot draw here" in warnings[0] and rundir.PLOTS in warnings[0], warnings
    assert warnings[0] in (run / rundir.TRAIN_LOG).read_text()
    assert (run / rundir.FINAL / "model.safetensors").is_file()
    assert not (run / rundir.PLOTS).exists() and not (run / (rundir.PLOTS + rundir.TMP)).exists()
