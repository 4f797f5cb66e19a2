"""A checkpoint carries the optimizer's state, not this machine's kernel choice: resuming keeps the fused /
foreach setting the current build chose (finetune.backends.fullstate.keep_kernel_choice). On CPU torch has a fused
AdamW, so both directions run here: a plain checkpoint resumed with optim.fused=true, and a fused one resumed plain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.backends.fullstate import KERNEL_KEYS, keep_kernel_choice
from tests.integration.conftest import new_trainer, tiny_recipe

pytestmark = pytest.mark.integration


def adamw(fused: bool | None) -> torch.optim.AdamW:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)


def one_step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()


@pytest.mark.parametrize(("saved", "built"), [(None, True), (True, None)])
def test_loaded_state_keeps_the_built_kernel(saved: bool | None, built: bool | None) -> None:
    source = adamw(saved)
    one_step(source)
    target = adamw(built)
    with torch.no_grad():  # the checkpoint's weights too
        for got, want in zip(target.param_groups[0]["params"], source.param_groups[0]["params"], strict=True):
            got.copy_(want)
    choice = [{k: g[k] for k in KERNEL_KEYS if k in g} for g in target.param_groups]
    target.load_state_dict(source.state_dict())
    assert target.param_groups[0]["fused"] == saved  # what torch does alone: the checkpoint's choice wins
    keep_kernel_choice(target, choice)
    assert target.param_groups[0]["fused"] == built
    one_step(target)  # the step counters are where the kernel wants them
    reference = adamw(saved)
    one_step(reference)
    one_step(reference)
    for got, want in zip(target.param_groups[0]["params"], reference.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # fused and plain agree to rounding
    assert float(target.state[target.param_groups[0]["params"][0]]["step"]) == 2.0


def test_resume_through_checkpoint_load_keeps_the_recipes_kernel(tmp_path: Path) -> None:
    from finetune.artifacts import checkpoint
    from finetune.config import validate
    from finetune.config.compose import Composed

    def trainer(name: str, fused: bool | None) -> Any:
        recipe = tiny_recipe(name=name, output_dir=str(tmp_path / name), optim={"lr": 1e-3, "fused": fused},
                             train={"max_steps": 2}, checkpoint={"every_steps": 2})
        return new_trainer(validate(Composed(recipe)))

    from finetune.runtime import loop

    plain = trainer("plain", None)
    loop.train(plain)
    ckpt = tmp_path / "plain" / "checkpoints" / "step-000002"
    assert ckpt.is_dir()
    fused = trainer("fused", True)
    checkpoint.load(fused.ctx.accelerator, ckpt, fused.state, fused.objects)
    groups = [g for opt in checkpoint._torch_optimizers(fused.ctx.accelerator._optimizers) for g in opt.param_groups]
    assert groups and all(g["fused"] is True for g in groups)
    assert fused.state.step == 2
