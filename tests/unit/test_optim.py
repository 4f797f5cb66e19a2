"""Learning-rate schedules and optimizer parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.config.schema import OptimConfig, SchedulerConfig
from finetune.optim import build_optimizer, build_scheduler, lr_factor


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_warmup_is_linear_and_never_zero(name: str) -> None:
    cfg = SchedulerConfig(name=name, warmup_steps=4)
    assert [lr_factor(s, cfg, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_decay_shapes() -> None:
    total = 10
    assert lr_factor(9, SchedulerConfig(name="constant"), total) == 1.0
    assert lr_factor(5, SchedulerConfig(name="linear"), total) == pytest.approx(0.5)
    assert lr_factor(5, SchedulerConfig(name="cosine"), total) == pytest.approx(0.5)
    assert lr_factor(2, SchedulerConfig(name="cosine"), total) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_factor(10, SchedulerConfig(name="cosine", min_lr_ratio=0.1), total) == pytest.approx(0.1)


def test_scheduler_follows_the_factor() -> None:
    model = torch.nn.Linear(3, 3)
    opt = build_optimizer(OptimConfig(lr=1.0), model)
    sched = build_scheduler(SchedulerConfig(name="linear", warmup_steps=2), opt, 6)
    seen = []
    for _ in range(6):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])


def test_weight_decay_only_on_matrices() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(OptimConfig(weight_decay=0.1), model)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
    sgd = build_optimizer(OptimConfig(name="sgd", lr=0.1, momentum=0.9), model)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
