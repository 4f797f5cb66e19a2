"""task: grpo on 2 CPU processes over gloo gives the 1-process numbers (FSDP2 in make test; ZeRO-3 and DDP in make
test-all: CI time).

Each completion is drawn from its own seed (train.seed, step, its prompt's position in the global batch, its number
in the group), so the two ranks generate between them exactly the completions one process generates; with
parameters sharded, every rank runs the same number of generation forwards (fixed-length decoding, filler eval
batches). Runs go through the real CLI, as in tests/distributed/test_backends.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.storage.metrics import read_metrics
from tests.distributed.test_backends import _assert_really_distributed, run_ok
from tests.integration.conftest import final_weights, max_rel_diff, tiny_recipe
from tests.integration.test_grpo import prompt_file
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed
EVAL_PROMPTS = 7  # not divisible by 2 ranks x eval batch 2: sharded ranks pad with filler batches


@pytest.fixture(scope="module")
def grpo_workdir(tmp_path_factory) -> Path:
    """4 steps of 4 prompts x 2 completions, loss token with 2 iterations per generation batch (the second
    step of each trains on a moved ratio, so the losses are not ~0), beta 0.05 with full fine-tuning (the KL to a
    frozen copy of the initial weights: sharded as the policy on FSDP2 / ZeRO-3), eval every 2 steps."""
    root = tmp_path_factory.mktemp("grpo-dist")
    recipe = tiny_recipe(
        task="grpo",
        data={"format": "prompt", "train": str(prompt_file(root)),
              "eval": str(prompt_file(root, rows=EVAL_PROMPTS, name="eval")), "max_seq_len": 32},
        grpo={"group_size": 2, "max_new_tokens": 4, "loss": "token", "iterations": 2, "beta": 0.05, "rewards": [
            {"function": "tests.integration.test_grpo:text_length", "name": "length", "weight": 0.1},
            {"exact_match": True}]},
        train={"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 4},
        optim={"name": "sgd", "lr": 0.5},
        scheduler={"name": "constant", "warmup_steps": 0},
        eval={"metrics": ["exact_match"], "batch_size": 2, "every_steps": 2},
    )
    write_recipe_file(root / "recipe.yaml", recipe)
    return root


@pytest.fixture(scope="module")
def grpo_single(grpo_workdir: Path) -> Path:
    """The 1-process run with the same global batch (micro 2 x accum 2)."""
    return run_ok(grpo_workdir, "single")


@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("zero3", marks=pytest.mark.extended),
                                     pytest.param("ddp", marks=pytest.mark.extended)])
def test_grpo_parity_with_one_process(grpo_workdir: Path, grpo_single: Path, backend: str) -> None:
    """The same completions (reward and length metrics equal), per-step losses and exported weights (<= 1e-4) as
    1 process; eval counts every prompt once."""
    run = run_ok(grpo_workdir, backend, "--accelerate-config", backend, "--num-processes", "2")
    _assert_really_distributed(run, backend, grpo_single)
    rows = [[r for r in read_metrics(x) if r["kind"] == "train"] for x in (run, grpo_single)]
    assert len(rows[0]) == 4
    for key in ("reward", "reward_length", "completion_len", "completion_len_max", "frac_zero_std", "truncated"):
        assert [r[key] for r in rows[0]] == pytest.approx([r[key] for r in rows[1]], rel=1e-6), key
    # the reference's log-probs: KL 0 at the first step (policy = reference), then equal to 1 process's (<= 1e-4)
    assert [r["kl"] for r in rows[0]] == pytest.approx([r["kl"] for r in rows[1]], rel=1e-4, abs=1e-7)
    assert rows[1][0]["kl"] == pytest.approx(0.0, abs=1e-6) and all(r["kl"] > 1e-6 for r in rows[1][1:])
    assert [r["loss"] for r in rows[0]] == pytest.approx([r["loss"] for r in rows[1]], rel=1e-4, abs=1e-6)
    assert any(abs(r["loss"]) > 1e-4 for r in rows[1]), "the losses are all ~0: nothing compared"
    assert max_rel_diff(final_weights(grpo_single), final_weights(run)) <= 1e-4
    evals = [[r for r in read_metrics(x) if r["kind"] == "eval"][-1] for x in (run, grpo_single)]
    assert evals[0]["eval_samples"] == evals[0]["eval_exact_match_total"] == EVAL_PROMPTS
    assert evals[0]["eval_reward"] == pytest.approx(evals[1]["eval_reward"], rel=1e-6)
    assert evals[0]["eval_exact_match_correct"] == evals[1]["eval_exact_match_correct"]
