"""finetune.artifacts.portable in one process: a single-process checkpoint read back as whole tensors equals the live
model and optimizer at that step (full and LoRA), and the portable load path continues a run exactly as the straight run
went on (losses and weights bit for bit), while the checkpoint stays as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from finetune import hooks
from finetune.storage import rundir
from finetune.storage.metrics import read_metrics
from tests.integration.conftest import final_weights, new_trainer, recipe_file, trained_run

pytestmark = pytest.mark.integration
SECTIONS: dict[str, Any] = {"train": {"max_steps": 8}, "checkpoint": {"every_steps": 4, "keep_last": 2},
                            "data": {"eval": None}, "optim": {"lr": 1.0e-3, "weight_decay": 0.1}}
LORA = {"peft": {"method": "lora", "dropout": 0.0}}


def _capture_at(step: int) -> dict[str, Any]:
    """The live model and optimizer (by parameter name) right after step ``step`` (its checkpoint is written)."""
    live: dict[str, Any] = {}

    def grab(trainer: Any) -> None:
        if trainer.state.step != step:
            return
        model = trainer.ctx.accelerator.unwrap_model(trainer.model)
        inner = trainer.optimizer.optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        live["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        live["trainable"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        live["state"] = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in inner.state.items()}
        live["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        live["group_names"] = [[names[id(p)] for p in g["params"]] for g in inner.param_groups]
        if hasattr(model, "peft_config"):
            from peft import get_peft_model_state_dict

            live["adapter"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}

    hooks.register("after_step", grab)
    return live


def _assert_optimizer_equal(read: dict[str, Any], live: dict[str, Any]) -> None:
    assert read["state"].keys() == live["state"].keys()
    for name, entry in live["state"].items():
        assert read["state"][name].keys() == entry.keys()
        assert all(torch.equal(read["state"][name][k], v) for k, v in entry.items()), name
    assert [g["params"] for g in read["param_groups"]] == live["group_names"]
    assert [{k: v for k, v in g.items() if k != "params"} for g in read["param_groups"]] == live["groups"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_read_full_state_equals_the_live_state(tmp_path: Path, lora: bool) -> None:
    from finetune.artifacts.portable import FullState, read_full_state

    live = _capture_at(4)
    run = trained_run(tmp_path, "run", **SECTIONS, **(LORA if lora else {}))
    ckpt = run / "checkpoints" / "step-000004"
    state = read_full_state(ckpt)
    assert isinstance(state, FullState) and (state.backend, state.world_size) == ("single", 1)
    expected = live["adapter"] if lora else live["model"]  # LoRA: peft's adapter-only keys
    assert state.model.keys() == expected.keys()
    assert all(torch.equal(state.model[k], v) for k, v in expected.items())
    assert state.optimizer is not None
    _assert_optimizer_equal(state.optimizer, live)
    assert live["state"] and all(float(s["step"]) == 4 for s in live["state"].values())
    model_only = read_full_state(ckpt, optimizer=False)
    assert model_only.optimizer is None and model_only.model.keys() == state.model.keys()


def test_portable_load_continues_exactly(tmp_path: Path) -> None:
    """The portable path (read_full_state, load_full_state through torch's full state dicts, then the rest of the
    checkpoint) from step 4 of a straight 8-step run gives its steps 5..8: the same losses and weights, exactly."""
    from finetune.artifacts import checkpoint
    from finetune.artifacts.portable import resume_from
    from finetune.config import load_recipe
    from finetune.runtime import loop

    straight = trained_run(tmp_path, "straight", **SECTIONS)
    ckpt = straight / "checkpoints" / "step-000004"
    before = rundir.inventory(ckpt)
    cfg, _ = load_recipe(recipe_file(tmp_path, "continued", **SECTIONS))
    trainer = new_trainer(cfg)
    try:
        ctx = trainer.ctx
        resume_from(ctx.accelerator, ctx.backend, trainer.model, trainer.optimizer, ckpt, ctx.run_dir)
        checkpoint.load(ctx.accelerator, ckpt, trainer.state, trainer.objects, model_and_optimizer=False)
        assert trainer.state.step == 4
        loop.train(trainer)
    finally:
        trainer.tracker.close()
    assert rundir.inventory(ckpt) == before and not rundir.reshard_scratch(trainer.ctx.run_dir).exists()
    weights = {k: v for k, v in trainer.model.state_dict().items() if k in final_weights(straight)}
    reference = final_weights(straight)
    assert weights.keys() == reference.keys()
    assert [k for k in reference if not torch.equal(weights[k], reference[k])] == []
    losses = [r["loss"] for r in read_metrics(straight) if r["kind"] == "train"][4:]
    assert [r["loss"] for r in read_metrics(trainer.ctx.run_dir) if r["kind"] == "train"] == losses



def test_a_checkpoint_without_param_names_still_resumes_natively(tmp_path: Path) -> None:
    """A checkpoint written before param_names.json existed resumes on its own layout exactly as before (the
    object is optional there), and says where it can go."""
    import json
    import shutil

    from finetune.artifacts.portable import resume_targets
    from tests.integration.conftest import cli_exit_code

    straight = trained_run(tmp_path, "straight", **SECTIONS)
    old = tmp_path / "old"
    shutil.copytree(straight, old)
    ckpt = old / "checkpoints" / "step-000004"
    (ckpt / "param_names.json").unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.pop("layout")
    manifest["files"] = rundir.inventory(ckpt)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert resume_targets(manifest) == "any world size, single or ddp only (no param names)"
    assert cli_exit_code("resume", str(old), "--from", "step-000004") == 0
    reference, weights = final_weights(straight), final_weights(old)
    assert [k for k in reference if not torch.equal(reference[k], weights[k])] == []
