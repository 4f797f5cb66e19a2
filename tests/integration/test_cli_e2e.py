"""End to end through the real console script, in subprocesses: `finetune run` then `finetune eval --json`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import tiny_recipe
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.integration
FINETUNE = [sys.executable, "-m", "finetune"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([*FINETUNE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_run_then_eval(tmp_path: Path) -> None:
    recipe = tiny_recipe(eval={"metrics": ["exact_match", "token_accuracy"], "every_steps": 2, "batch_size": 64})
    recipe.pop("checkpoint")
    write_recipe_file(tmp_path / "r.yaml", recipe)
    done = _cli("run", "r.yaml", "-o", "runs/e2e", "train.max_steps=4", "checkpoint.every_steps=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "runs" / "e2e"
    assert (run / "recipe.resolved.yaml").is_file()
    assert yaml.safe_load((run / "recipe.resolved.yaml").read_text())["train"]["max_steps"] == 4
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in (run / "final").iterdir()}
    log = (run / "train.log").read_text()
    assert "step 4/4 | loss " in log and " | tok/s " in log
    rows = read_metrics(run)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    train_keys = {"step", "loss", "lr", "grad_norm", "tokens", "elapsed_s"}
    assert all(train_keys <= r.keys() for r in rows if r["kind"] == "train")
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert {"eval_loss", "eval_ppl", "eval_exact_match", "eval_correct", "eval_total"} <= evals[-1].keys()

    shown = _cli("eval", "runs/e2e", "--json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    metrics = json.loads(shown.stdout)
    assert metrics["eval_total"] == evals[-1]["eval_total"] == 200
    assert metrics["eval_correct"] == evals[-1]["eval_correct"]
    assert metrics["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)

    again = _cli("run", "r.yaml", "-o", "runs/e2e", cwd=tmp_path)
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr
    assert (run / "final" / "model.safetensors").is_file()
