"""The custom (non-Hugging-Face) plugin row under FSDP2 on 2 CPU processes gives the 1-process numbers.

One 2-process run (CI time is tight): FSDP2 wraps the row's ``TinyBlock`` by class name and really shards every
parameter (each rank holds about half of them, reported by tests/distributed/dist_hooks.py), the per-step losses,
the eval and the exported state dict match the 1-process run within 1e-4, and `finetune eval` of the 2-process
export gives its own logged eval.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.storage.metrics import read_metrics
from tests.distributed.paths import side_file
from tests.distributed.test_backends import _finetune, run_ok
from tests.integration.conftest import final_weights, max_rel_diff
from tests.integration.test_custom_model import custom_recipe
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``recipe.yaml``: 8 steps of global batch 8 (micro 4), no dropout, an eval at step 4 and at step 8."""
    root = tmp_path_factory.mktemp("dist-custom")
    recipe = custom_recipe(model={"config_overrides": {}}, train={"max_steps": 8},
                           eval={"every_steps": 4, "batch_size": 8}, checkpoint={"every_steps": None})
    write_recipe_file(root / "recipe.yaml", recipe)
    return root


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def test_fsdp2_on_two_processes_matches_one_process(custom_dir: Path) -> None:
    reference = run_ok(custom_dir, "single")
    run = run_ok(custom_dir, "fsdp2", "--accelerate-config", "fsdp2", "--num-processes", "2")
    total = sum(t.numel() for t in final_weights(reference).values())
    for rank in (0, 1):
        facts = json.loads(side_file(run, f"rank-{rank}.json").read_text())
        assert facts["num_processes"] == 2 and facts["rank"] == rank and facts["fsdp_version"] == 2
        assert facts["distributed_type"] == "DistributedType.FSDP" and facts["backend"] == "fsdp2"
        assert facts["local_param_numel"] < 0.75 * total, facts  # sharded, not replicated
    assert len(_losses(run)) == 8
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-4)
    assert max_rel_diff(final_weights(reference), final_weights(run)) <= 1e-4
    assert "FSDP" in (run / "train.log").read_text()
    evals = [[r for r in read_metrics(x) if r["kind"] == "eval"] for x in (run, reference)]
    assert [r["step"] for r in evals[0]] == [r["step"] for r in evals[1]] == [4, 8]
    assert evals[0][-1]["eval_loss"] == pytest.approx(evals[1][-1]["eval_loss"], rel=1e-4)
    assert evals[0][-1]["eval_token_accuracy_total"] == evals[1][-1]["eval_token_accuracy_total"]
    # the 2-process export, loaded back into the factory's model
    done = _finetune("eval", str(run), "--json", "--trust-remote-code")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["eval_loss"] == pytest.approx(evals[0][-1]["eval_loss"], rel=1e-5)
