"""`task: reward` on 2 CPU processes (DDP, and ZeRO-3 which shards the parameters) gives the 1-process numbers: the
pair count is all-reduced before the one division, both halves of a pair are scored on the same rank, and eval
counts every pair once (an odd number of them, not a multiple of ranks x batch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.storage.metrics import read_metrics
from tests.distributed.paths import side_file
from tests.distributed.test_backends import run_ok
from tests.integration.conftest import final_weights, max_rel_diff
from tests.integration.test_reward import preference_rows, reward_recipe
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed
EVAL_PAIRS = 37


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dist-reward")
    files = {"train": root / "train.jsonl", "eval": root / "eval.jsonl"}
    for path, count, seed in ((files["train"], 64, 0), (files["eval"], EVAL_PAIRS, 1)):
        path.write_text("".join(json.dumps(r) + "\n" for r in preference_rows(count, seed)))
    recipe = reward_recipe(files, train={"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 6},
                           eval={"batch_size": 8, "every_steps": 3})
    write_recipe_file(root / "recipe.yaml", recipe)
    return root


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


# fsdp2 in make test-all (CI time): zero3 is the sharded case in make test
# ddp and fsdp2 in make test-all (CI time): the reward task's reduction over ranks is the same on every backend,
# and zero3 (sharded parameters, gathered for eval) is the hardest of the three
@pytest.mark.parametrize("backend,shards", [pytest.param("ddp", False, marks=pytest.mark.extended),
                                            pytest.param("fsdp2", True, marks=pytest.mark.extended),
                                            ("zero3", True)])
def test_reward_parity_with_one_process(reward_dir: Path, backend: str, shards: bool) -> None:
    """Per-step losses, eval loss and counts, and exported weights match the 1-process run within 1e-4."""
    reference = reward_dir / "single"
    if not reference.is_dir():
        run_ok(reward_dir, "single")
    run = run_ok(reward_dir, backend, "--accelerate-config", backend, "--num-processes", "2")
    for rank in (0, 1):
        facts = json.loads(side_file(run, f"rank-{rank}.json").read_text())
        assert facts["num_processes"] == 2 and facts["backend"] == backend
        total = sum(t.numel() for t in final_weights(reference).values())
        assert (facts["local_param_numel"] < 0.75 * total) if shards else (facts["local_param_numel"] == total)
    assert len(_losses(run)) == 6
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-4)
    assert max_rel_diff(final_weights(reference), final_weights(run)) <= 1e-4
    got, want = ([r for r in read_metrics(x) if r["kind"] == "eval"] for x in (run, reference))
    assert len(got) == len(want) == 2
    for a, b in zip(got, want, strict=True):
        assert a["eval_preference_accuracy_total"] == b["eval_preference_accuracy_total"] == EVAL_PAIRS
        assert a["eval_preference_accuracy_correct"] == b["eval_preference_accuracy_correct"]
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-4)
