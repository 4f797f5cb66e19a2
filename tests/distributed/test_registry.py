"""Rows of the SupportedModel table beyond the dense Llama of tests/distributed/test_backends.py, on 2 CPU processes
(gloo), give the 1-process numbers under FSDP2 and ZeRO-3:

- GPT-OSS, the mixture-of-experts row with the most of its own (experts loaded from MXFP4 blocks as on the hub, by
  rank 0 alone where the backend lets it; attention sinks; biased experts), its router load-balancing loss on
  (coefficient 0.9). The experts' fused 3-D weights are sharded / partitioned, and the router's aux loss is weighted
  by each micro-batch's targets across ranks as across accumulation steps (finetune.tasks.router).
- Gemma 2, the dense row with the most of its own: tied input and output embeddings (one parameter the backends
  shard and the export writes once), sliding-window and full layers, soft-capped attention (eager) and the final
  logit soft-cap the loss applies per chunk.

Each rank runs one micro-batch of 4 per step where the 1-process run accumulates two: the same micro-batches, so
the loss, the logged aux_loss (both reduced over the ranks) and the exported weights match within 1e-4. One
reference per row (in this process) and two launches per row: the parity of the other backends, resuming and LoRA
under them are the Llama row's (tests/distributed/test_backends.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.storage.metrics import read_metrics
from tests.distributed.conftest import made_once, session_folder
from tests.distributed.test_backends import EVAL_ROWS, _assert_really_distributed, run_ok
from tests.integration.conftest import DATA, final_weights, max_rel_diff, run_in_process, tiny_recipe
from tests.moe_rows import pretrained
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed


ROWS = ("gpt_oss", "gemma2")


@pytest.fixture(scope="module", params=ROWS)
def row_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``recipe.yaml``: the row's tiny model from a pretrained folder (GPT-OSS's experts as MXFP4), weight decay,
    clipping, cosine with warm-up, 6 steps of global batch 8 (micro 4), an eval at the end. One folder per row for
    the session's xdist workers."""
    root = session_folder(tmp_path_factory, f"dist-row-{request.param}")
    made_once(root / "recipe.yaml", lambda: _write(root, request.param))
    return root


def _write(root: Path, name: str) -> None:
    lines = (DATA / "reverse_eval.jsonl").read_text().splitlines()[:EVAL_ROWS]
    (root / "eval.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tiny_recipe(
        model={"type": name, "path": str(pretrained(root / "pretrained", name))},
        optim={"lr": 1.0e-3, "weight_decay": 0.5},
        scheduler={"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
        data={"eval": str(root / "eval.jsonl")},
        train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 6, "max_grad_norm": 1.0},
        eval={"metrics": ["token_accuracy"], "batch_size": 8},
    )
    write_recipe_file(root / "recipe.yaml", recipe)


@pytest.fixture(scope="module")
def row_reference(row_dir: Path) -> Path:
    """The 1-process run (micro 4 x accum 2), trained in this process (no launch)."""
    from finetune.config import load_recipe

    def make() -> None:
        run_in_process(load_recipe(row_dir / "recipe.yaml", [f"output_dir={row_dir / 'single'}"])[0])

    return made_once(row_dir / "single", make)


def _train_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r["kind"] == "train"]


@pytest.mark.parametrize("backend", ["fsdp2", "zero3"])
def test_parity_with_one_process(row_dir: Path, row_reference: Path, backend: str) -> None:
    run = run_ok(row_dir, backend, "--accelerate-config", backend, "--num-processes", "2")
    _assert_really_distributed(run, backend, row_reference)
    ours, theirs = _train_rows(run), _train_rows(row_reference)
    assert len(ours) == 6
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], rel=1e-4)
    if "aux_loss" in theirs[0]:  # the MoE row's router loss
        assert [r["aux_loss"] for r in ours] == pytest.approx([r["aux_loss"] for r in theirs], rel=1e-4)
    assert all(("aux_loss" in r) == ("aux_loss" in theirs[0]) for r in ours)
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in theirs]
    assert max_rel_diff(final_weights(row_reference), final_weights(run)) <= 1e-4
    evals = [[r for r in read_metrics(x) if r["kind"] == "eval"][-1] for x in (run, row_reference)]
    assert evals[0]["eval_samples"] == EVAL_ROWS
    assert evals[0]["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-4)
    assert evals[0]["eval_token_accuracy_correct"] == evals[1]["eval_token_accuracy_correct"]
