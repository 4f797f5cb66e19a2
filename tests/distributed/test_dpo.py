"""task: dpo on 2 CPU processes over gloo under DDP, FSDP2 and ZeRO-3 gives the 1-process numbers.

The reference pass runs fixed batches by global index on every rank (fillers keep sharded ranks in lockstep) and
all-gathers the results, so the reference log-probs, and with them every loss, do not depend on the process count
or the backend. Runs go through the real CLI, as in tests/distributed/test_backends.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from finetune.storage.metrics import read_metrics
from tests.distributed.test_backends import _assert_really_distributed, run_ok
from tests.integration.conftest import DATA, final_weights, max_rel_diff, tiny_recipe
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed
EVAL_PAIRS = 37  # not divisible by 2 ranks x eval batch 8


@pytest.fixture(scope="module")
def dpo_workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo-dist")
    lines = (DATA / "reverse_pref_eval.jsonl").read_text().splitlines()[:EVAL_PAIRS]
    (root / "eval.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tiny_recipe(
        data={"format": "preference", "train": str(DATA / "reverse_pref_train.jsonl"),
              "eval": str(root / "eval.jsonl")},
        train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 8},
        eval={"metrics": ["preference_accuracy"], "batch_size": 8, "every_steps": 4},
    )
    recipe["task"] = "dpo"
    write_recipe_file(root / "recipe.yaml", recipe)
    return root


@pytest.fixture(scope="module")
def dpo_single(dpo_workdir: Path) -> Path:
    """The 1-process DPO run with the same global batch (micro 4 x accum 2)."""
    return run_ok(dpo_workdir, "single")


def _reference_line(run: Path) -> str:
    """The reference pass's summary (pair count and mean log-probs), without its timing."""
    found = re.search(r"reference log-probs: (\d+) pairs in [\d.]+s; (.*)", (run / "train.log").read_text())
    assert found, "no reference summary in train.log"
    return f"{found.group(1)} {found.group(2)}"


# ddp in make test-all (CI time): the sharded backends are where DPO's reference pass and gathers differ
@pytest.mark.parametrize("backend", [pytest.param("ddp", marks=pytest.mark.extended), "fsdp2", "zero3"])
def test_dpo_parity_with_one_process(dpo_workdir: Path, dpo_single: Path, backend: str) -> None:
    """Same reference log-probs, per-step losses and exported weights (<= 1e-4) as 1 process; eval counts every
    pair once."""
    run = run_ok(dpo_workdir, backend, "--accelerate-config", backend, "--num-processes", "2")
    _assert_really_distributed(run, backend, dpo_single)
    assert _reference_line(run) == _reference_line(dpo_single)
    losses = [[r["loss"] for r in read_metrics(x) if r["kind"] == "train"] for x in (run, dpo_single)]
    assert len(losses[0]) == 8 and losses[0] == pytest.approx(losses[1], rel=1e-4)
    assert max_rel_diff(final_weights(dpo_single), final_weights(run)) <= 1e-4
    evals = [[r for r in read_metrics(x) if r["kind"] == "eval"][-1] for x in (run, dpo_single)]
    assert evals[0]["eval_samples"] == evals[0]["eval_preference_accuracy_total"] == EVAL_PAIRS
    assert evals[0]["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-4)
    assert evals[0]["eval_preference_accuracy_correct"] == evals[1]["eval_preference_accuracy_correct"]
