"""A run whose learning rate is far too high collapses: its loss pins at ln(vocab) with a zero gradient (every number
finite, every logit equal). It stops with exit code 3 and one line, exports nothing, does not finish, and keeps the
checkpoint from before the collapse (none is saved during it, so keep_last cannot rotate that one out)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from finetune.registry import get_model
from finetune.runtime import collapse
from finetune.storage import rundir
from finetune.storage.metrics import read_metrics
from finetune.storage.summary import read_summary
from tests.cli_helpers import main_exit
from tests.integration.conftest import recipe_file, sigterm_after
from tests.integration.test_safety import one_error_line

pytestmark = pytest.mark.integration
HUGE_LR = {"lr": 1.0e3}  # the optim.lr=1e3: a few exploding steps, then every logit equal


def _run(tmp_path: Path, name: str, max_steps: int, monkeypatch, capsys) -> tuple[int, str, Path]:
    """``finetune run`` of the tiny recipe at HUGE_LR, a checkpoint every step, keep_last 1: (exit code, the one error
    line, run dir)."""
    recipe = recipe_file(tmp_path, name, optim=HUGE_LR, data={"eval": None}, train={"max_steps": max_steps},
                         checkpoint={"every_steps": 1, "keep_last": 1})
    code, _, err = main_exit(monkeypatch, capsys, "run", str(recipe))
    return code, one_error_line(err) if code else err, tmp_path / name


def _stopped_unfinished(run: Path, line: str, first: int) -> None:
    """Nothing exported, no end row (not finished), train.log ends with the line, and the only checkpoint is the
    one of the step before the collapse, which the line says to resume from."""
    assert not (run / rundir.FINAL).exists() and read_summary(run) is None
    assert (run / rundir.TRAIN_LOG).read_text().rstrip().endswith(line.removeprefix("error: "))
    kept = rundir.step_dir(run, first - 1).name
    assert [path.name for path in rundir.checkpoint_dirs(run)] == [kept]
    assert f"finetune resume {run} --from {kept} optim.lr=... --allow-config-change" in line


def test_a_collapsing_run_stops_with_exit_3_and_keeps_the_checkpoint_before_it(tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    vocab = get_model("tiny-llama").tiny_config["vocab_size"]
    code, line, run = _run(tmp_path, "collapse", 30, monkeypatch, capsys)
    assert code == 3, line
    rows = [row for row in read_metrics(run) if row["kind"] == "train"]
    dead = [row["step"] for row in rows if row["grad_norm"] == 0.0]
    assert dead and all(row["loss"] == pytest.approx(math.log(vocab), rel=1e-6) for row in rows if row["step"] in dead)
    first, stop = dead[0], dead[0] + collapse.STEPS - 1
    assert first > 1  # at least one live step first: its checkpoint is the one kept
    assert dead == list(range(first, stop + 1)) and rows[-1]["step"] == stop  # stopped at once
    assert line.startswith(f"error: training collapsed: for {collapse.STEPS} steps in a row up to step {stop} the "
                           f"gradient norm was 0 and the loss sat at ln({vocab}) = {math.log(vocab):.4f}")
    assert "nothing was exported" in line and f"optim.lr {HUGE_LR['lr']:g}" in line
    _stopped_unfinished(run, line, first)
    assert f"step {first}: checkpoint not saved: the model looks collapsed" in (run / rundir.TRAIN_LOG).read_text()

    # the same run ending on its first collapsed step: that model would be the export, so it stops there
    code, line, run = _run(tmp_path, "last", first, monkeypatch, capsys)
    assert code == 3 and line.startswith(f"error: training collapsed: for 1 step up to step {first} "), line
    _stopped_unfinished(run, line, first)

    # ... and so does a SIGTERM that arrives during it: no collapsed checkpoint is saved for a resume
    sigterm_after(first - 1)
    code, line, run = _run(tmp_path, "signal", 30, monkeypatch, capsys)
    assert code == 3 and line.startswith(f"error: training collapsed: for 1 step up to step {first} "), line
    _stopped_unfinished(run, line, first)
