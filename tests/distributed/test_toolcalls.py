"""Tool-calling chat rows on 2 processes give the 1-process numbers: the same per-step losses and exported weights,
and eval's tool_calls counts every held-out row once (its calls compared on the rank that holds the row). The rows
go through the samples, collators and loop every chat row does; this checks the tools path end to end on a sharded
backend. In make test-all (CI time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.storage.metrics import read_metrics
from tests.distributed.test_backends import _assert_really_distributed, run_ok
from tests.integration.conftest import DATA, final_weights, max_rel_diff, tiny_recipe
from tests.recipe_files import write_recipe_file

pytestmark = [pytest.mark.distributed, pytest.mark.extended]
EVAL_ROWS = 37  # not divisible by 2 ranks x eval batch 8


@pytest.fixture(scope="module")
def tools_workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tools-dist")
    lines = (DATA / "tools_eval.jsonl").read_text().splitlines()[:EVAL_ROWS]
    (root / "eval.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tiny_recipe(
        model={"type": "tiny-llama-tools"},
        data={"format": None, "train": str(DATA / "tools_train.jsonl"), "eval": str(root / "eval.jsonl"),
              "max_seq_len": 384},
        train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 6},
        eval={"metrics": ["tool_calls"], "batch_size": 8, "every_steps": 6, "max_new_tokens": 8},
    )
    write_recipe_file(root / "recipe.yaml", recipe)
    return root


def test_tool_rows_train_and_score_alike_on_two_processes(tools_workdir: Path) -> None:
    single = run_ok(tools_workdir, "single")
    run = run_ok(tools_workdir, "fsdp2", "--accelerate-config", "fsdp2", "--num-processes", "2")
    _assert_really_distributed(run, "fsdp2", single)
    losses = [[r["loss"] for r in read_metrics(x) if r["kind"] == "train"] for x in (run, single)]
    assert len(losses[0]) == 6 and losses[0] == pytest.approx(losses[1], rel=1e-4)
    assert max_rel_diff(final_weights(single), final_weights(run)) <= 1e-4
    evals = [[r for r in read_metrics(x) if r["kind"] == "eval"][-1] for x in (run, single)]
    assert evals[0]["eval_tool_calls_total"] == evals[1]["eval_tool_calls_total"] == EVAL_ROWS
    assert evals[0]["eval_tool_calls_correct"] == evals[1]["eval_tool_calls_correct"]
    assert evals[0]["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-4)
