"""task: distill on 2 CPU processes over gloo gives the 1-process numbers: FSDP2 in make test (the teacher sharded
as the student: fully_shard), ZeRO-3 (the teacher an engine of its own, partitioned), and DDP, FSDP1 and ZeRO-2
(the teacher whole on each process) in make test-all.

On-policy with lmbda 0.5: the steps that sample decide from (seed, step) and each completion is drawn from its own
seed (seed, step, row position), so the two ranks sample between them exactly the completions one process samples;
sharded ranks run the same number of generation, teacher and eval forwards (fixed-length decoding, filler eval
batches). Runs go through the real CLI, as in tests/distributed/test_backends.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.storage.metrics import read_metrics
from tests.distributed.test_backends import _assert_really_distributed, run_ok
from tests.integration.conftest import final_weights, max_rel_diff, tiny_recipe
from tests.integration.test_distill import make_teacher
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed
DATA = Path(__file__).resolve().parents[2] / "recipes" / "data"


@pytest.fixture(scope="module")
def distill_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps of 4 rows (micro 2), on-policy reverse KL at lmbda 0.5 (both kinds of step occur) from a wider teacher,
    with the backend parity's real settings (AdamW with weight decay, clipping, a cosine schedule with warm-up); eval of
    7 rows (not divisible by 2 ranks x eval batch 2) at steps 2 and 4."""
    root = tmp_path_factory.mktemp("distill-dist")
    teacher = make_teacher(root / "teacher", hidden_size=96, intermediate_size=192)
    eval_rows = root / "eval.jsonl"
    eval_rows.write_text("".join((DATA / "reverse_eval.jsonl").read_text().splitlines(keepends=True)[:7]))
    recipe = tiny_recipe(
        task="distill", data={"eval": str(eval_rows)},
        distill={"teacher": str(teacher), "mode": "on_policy", "loss": "reverse_kl", "lmbda": 0.5,
                 "max_new_tokens": 4},
        train={"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 4, "max_grad_norm": 1.0},
        optim={"lr": 1.0e-3, "weight_decay": 0.5}, scheduler={"name": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1},
        eval={"metrics": ["token_accuracy"], "batch_size": 2, "every_steps": 2})
    write_recipe_file(root / "recipe.yaml", recipe)
    return root


@pytest.fixture(scope="module")
def distill_single(distill_workdir: Path) -> Path:
    return run_ok(distill_workdir, "single")


@pytest.mark.parametrize("backend", ["fsdp2", *(pytest.param(name, marks=pytest.mark.extended)
                                               for name in ("zero3", "ddp", "fsdp1", "zero2"))])
def test_distill_parity_with_one_process(distill_workdir: Path, distill_single: Path, backend: str) -> None:
    """The same sampled steps and completion lengths, per-step losses, divergences and teacher log-probs, eval
    metrics (the teacher's eval loss included) and exported weights (<= 1e-4) as 1 process; the teacher is sharded
    where the student is."""
    run = run_ok(distill_workdir, backend, "--accelerate-config", backend, "--num-processes", "2")
    _assert_really_distributed(run, backend, distill_single)
    rows = [[r for r in read_metrics(x) if r["kind"] == "train"] for x in (run, distill_single)]
    assert len(rows[0]) == 4 and [r.keys() for r in rows[0]] == [r.keys() for r in rows[1]]
    assert any("completion_len" in r for r in rows[1]) and not all("completion_len" in r for r in rows[1])
    for key in ("loss", "divergence", "completion_len", "teacher_logprob"):
        mine = [r[key] for r in rows[0] if key in r]
        assert mine == pytest.approx([r[key] for r in rows[1] if key in r], rel=1e-4), key
    assert max_rel_diff(final_weights(distill_single), final_weights(run)) <= 1e-4
    evals = [[r for r in read_metrics(x) if r["kind"] == "eval"][-1] for x in (run, distill_single)]
    assert evals[0]["eval_samples"] == 7
    for key in ("eval_loss", "eval_divergence", "eval_teacher_loss", "eval_token_accuracy"):
        assert evals[0][key] == pytest.approx(evals[1][key], rel=1e-4), key
    sharded = "sharded as the student" if backend in ("fsdp2", "zero3") else "whole on each process"
    assert sharded in (run / "train.log").read_text()
