"""An eval that fails during a run (out of memory at the end is the usual case) loses nothing: the step's checkpoint
and the final export are written before it, the error is one line with its own exit code (4), and the run can be
evaluated or resumed from what was kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from finetune.runtime import loop
from tests.cli_helpers import main_exit
from tests.integration.conftest import tiny_recipe, write_named

pytestmark = pytest.mark.integration

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)"


def _failing_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """loop.evaluate raises an out-of-memory RuntimeError at ``step`` (as torch does on a GPU), works otherwise."""
    real = loop.evaluate

    def evaluate(t: Any) -> dict[str, Any]:
        if t.state.step == step:
            raise RuntimeError(OOM)
        return real(t)

    monkeypatch.setattr(loop, "evaluate", evaluate)


def _recipe(tmp_path: Path) -> Path:
    return write_named(tmp_path, "evalfail", tiny_recipe(train={"max_steps": 4}, eval={"every_steps": 2},
                                                         checkpoint={"every_steps": 2}))


def _eval_rows(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if "eval_loss" in row]


def test_a_failed_final_eval_keeps_the_export_and_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    recipe, run = _recipe(tmp_path), tmp_path / "evalfail"
    _failing_at(monkeypatch, 4)
    code, _, err = main_exit(monkeypatch, capsys, "run", str(recipe))
    lines = err.strip().splitlines()
    assert code == 4, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert lines[-1].startswith("error: eval at step 4 failed (RuntimeError: CUDA out of memory"), err
    assert "step-000004 is the newest resumable checkpoint" in lines[-1] and "eval.batch_size" in lines[-1]
    assert (run / "final" / "model.safetensors").is_file()  # exported before the eval
    assert (run / "checkpoints" / "step-000004" / "manifest.json").is_file()  # saved before the eval
    assert _eval_rows(run) == [2]
    monkeypatch.undo()
    code, out, err = main_exit(monkeypatch, capsys, "eval", str(run), "--json")
    assert code == 0, err
    assert json.loads(out)["eval_samples"] > 0


def test_a_failed_eval_mid_run_leaves_the_run_resumable_from_that_step(tmp_path, monkeypatch, capsys):
    recipe, run = _recipe(tmp_path), tmp_path / "evalfail"
    _failing_at(monkeypatch, 2)
    code, _, err = main_exit(monkeypatch, capsys, "run", str(recipe))
    assert code == 4, err
    assert err.strip().splitlines()[-1].startswith("error: eval at step 2 failed"), err
    assert "finetune resume" in err and not (run / "final").exists()
    assert (run / "checkpoints" / "step-000002" / "manifest.json").is_file()
    monkeypatch.undo()
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(run))
    assert code == 0, err
    assert (run / "final" / "model.safetensors").is_file()
    assert _eval_rows(run) == [4]  # the failed step-2 eval logged nothing; the resumed run evaluates at its end
