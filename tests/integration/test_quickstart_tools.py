"""The tools quickstart learns what the docs promise (docs/getting-started/quickstart.md): held-out tool calls,
compared as data, from none right at step 0 to most of them. Three minutes of training on two cores: run by
``make test-all`` (marked extended), not by the CI suite, whose budget it would break; the recipe itself is
validated and planned with every shipped recipe in the default suite."""

from __future__ import annotations

import json

import pytest

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import REPO, run_in_process

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.extended]


def test_the_tools_quickstart_calls_held_out_tools_right(tmp_path) -> None:
    from finetune.config import load_recipe

    cfg, _ = load_recipe(REPO / "recipes" / "tools-quickstart.yaml",
                         [f"output_dir={tmp_path / 'run'}", "checkpoint.every_steps=null", "eval.every_steps=300"])
    run_in_process(cfg)
    evals = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[0]["eval_tool_calls"] == 0
    assert evals[-1]["step"] == 600 and evals[-1]["eval_tool_calls"] >= 0.85  # 167/180 measured
    held_out = [json.loads(line) for line in (REPO / "recipes" / "data" / "tools_eval.jsonl").read_text().splitlines()]
    assert evals[-1]["eval_tool_calls_total"] == len(held_out) == 180
    trained = {json.loads(line)["messages"][0]["content"]
               for line in (REPO / "recipes" / "data" / "tools_train.jsonl").read_text().splitlines()}
    assert not trained & {row["messages"][0]["content"] for row in held_out}  # every eval request is new
