"""Run folders behave as a user expects, through the real entry point in this process.

- A run that fails its data check, or fails before its first step, leaves no run folder behind (only what that
  invocation created is removed: a folder that existed stays, empty, as it was).
- ``--dry-run`` says when the real run would be refused; a refusal suggests ``finetune resume`` only where there
  is a checkpoint to resume.
- Ctrl+C prints the stop message once; the resumed run ends with its summary, which ``finetune ls`` shows again
  line for line; resuming the finished run again says there is nothing to do (exit 0) and changes nothing.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from finetune import hooks
from finetune.errors import ConfigError
from finetune.storage import rundir
from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import DATA, recipe_file

pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def test_a_run_that_fails_before_training_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n')
    recipe = recipe_file(tmp_path, "baddata", data={"train": str(bad), "eval": None})
    code, _, err = main_exit(monkeypatch, capsys, "run", str(recipe), "-o", "runs/nested/baddata")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: ") and "bad.jsonl:2" in err, err
    assert not (tmp_path / "runs").exists()  # the data check comes before the folder

    def broken_model(*_args: Any) -> None:
        raise ConfigError("model.path: this model cannot train here (a stand-in for a model-side mistake)")

    monkeypatch.setattr("finetune.runtime.modeling.check_fits", broken_model)  # fails after the folder exists
    recipe = recipe_file(tmp_path, "badmodel", train={"max_steps": 2})
    code, _, err = main_exit(monkeypatch, capsys, "run", str(recipe), "-o", "runs/nested/badmodel")
    assert code == 2 and "stand-in for a model-side mistake" in err, err
    assert not (tmp_path / "runs").exists()  # the folder and the parents this run made are gone
    (tmp_path / "mine").mkdir()  # a folder the user made: it stays, as empty as it was
    code, _, err = main_exit(monkeypatch, capsys, "run", str(recipe), "-o", "mine")
    assert code == 2 and "stand-in" in err, err
    assert (tmp_path / "mine").is_dir() and not list((tmp_path / "mine").iterdir())


def test_dry_run_says_the_real_run_would_be_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    recipe = recipe_file(tmp_path, "dry")
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe), "--dry-run")
    assert code == 0 and "refused" not in out + err, err
    rundir.create(tmp_path / "dry", overwrite=False).release()  # a run that holds no checkpoint
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe), "--dry-run")
    assert code == 0, err
    refusal = [line for line in out.splitlines() if line.startswith("# the real run would be refused: ")]
    assert len(refusal) == 1 and "already holds a run; pass --overwrite" in refusal[0], out
    assert err.strip() == "warning: " + refusal[0].removeprefix("# "), err
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe), "--dry-run", "--overwrite")
    assert code == 0 and "refused" not in out + err, err
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe))
    assert_user_error(code, out, err, "already holds a run")
    assert "finetune resume" not in err  # nothing to resume: no checkpoint


def test_ctrl_c_says_stop_once_then_the_run_ends_with_its_summary_and_resume_has_nothing_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    evals = tmp_path / "eval.jsonl"  # a small eval set: the final eval is not what is tested
    evals.write_text("".join((DATA / "reverse_eval.jsonl").read_text().splitlines(keepends=True)[:16]))
    recipe = recipe_file(tmp_path, "sigint", train={"max_steps": 3}, eval={"metrics": ["token_accuracy"]},
                         checkpoint={"every_steps": 1}, data={"eval": str(evals)})
    run = tmp_path / "sigint"

    def interrupt(trainer: Any) -> None:
        if trainer.state.step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    hooks.clear()
    hooks.register("after_step", interrupt)
    try:
        code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe))
    finally:
        hooks.clear()
    assert code == 130, err
    stops = [line for line in (out + err).splitlines() if "stopped by signal" in line]
    assert len(stops) == 1 and "finetune resume" in stops[0], out + err
    assert stops[0] in (run / rundir.TRAIN_LOG).read_text()  # the log keeps it

    code, out, err = main_exit(monkeypatch, capsys, "resume", str(run))
    assert code == 0, err
    start = next(i for i, line in enumerate(out.splitlines()) if line.startswith("run sigint finished: 3 steps, "))
    summary = out.splitlines()[start:]
    assert summary[1].startswith("  final train loss: ") and "(step 3)" in summary[1], summary
    assert summary[2:5] == ["  final eval (step 3):", summary[3], summary[4]] and "eval_loss = " in summary[3]
    assert any(line.startswith("    eval_token_accuracy ") and "/" in line for line in summary), summary
    assert "  model:   sigint/final" in summary and "  plot:    sigint/plots.png" in summary
    assert "    finetune eval sigint" in summary and not any("finetune merge" in line for line in summary)
    assert all(line in (run / rundir.TRAIN_LOG).read_text() for line in summary)

    code, out, err = main_exit(monkeypatch, capsys, "ls", str(run))
    assert code == 0, err
    assert out.splitlines()[-len(summary):] == summary  # the same lines, read back from what the run wrote

    log, final = (run / rundir.TRAIN_LOG).read_bytes(), (run / rundir.FINAL / rundir.MANIFEST).read_bytes()
    code, out, err = main_exit(monkeypatch, capsys, "resume", str(run))
    assert code == 0 and err == "", err
    assert out.splitlines() == [f"{run}: finished, nothing to resume (step-000003 is step 3 of 3; final/ exported "
                                f"at that step). Train longer: `finetune resume {run} train.max_steps=N "
                                f"--allow-config-change`; evaluate: `finetune eval {run}`"]
    assert (run / rundir.TRAIN_LOG).read_bytes() == log and (run / rundir.FINAL / rundir.MANIFEST).read_bytes() == final
    assert not (run / rundir.RESUMING).exists()
