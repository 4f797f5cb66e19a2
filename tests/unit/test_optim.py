"""Learning-rate schedules and optimizer parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.config.schema import OptimConfig, SchedulerConfig
from finetune.runtime.optim import build_optimizer, build_scheduler, lr_factor


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


def _partitioned_like_zero3(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as ZeRO-3 holds a model built partitioned (``deepspeed.zero.Init``): every parameter's ``.data`` an
    empty 1-D placeholder, its real shape in ``ds_shape`` (and ``ds_numel``)."""
    for param in model.parameters():
        param.ds_shape, param.ds_numel = param.shape, param.numel()
        param.data = torch.empty(0, dtype=param.dtype)
    return model


def _layout(opt: torch.optim.Optimizer, names: dict[int, str]) -> list[tuple[float, list[str]]]:
    return [(g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in opt.param_groups]


def test_groups_see_the_whole_shape_of_partitioned_parameters() -> None:
    """A model partitioned at birth under ZeRO-3 gets the optimizer groups of the whole model (weight decay on its
    matrices, not silently nowhere), so a checkpoint's groups match on any backend and world size; counts of frozen
    and trainable elements are of whole tensors too."""
    import dataclasses

    from finetune.backends import full_numel, full_shape
    from finetune.registry import SUPPORTED_MODELS
    from finetune.runtime.modeling import freeze
    from finetune.runtime.peft import parameter_counts

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))

    cfg = OptimConfig(weight_decay=0.5)
    whole, parted = make(), _partitioned_like_zero3(make())
    assert [p.ndim for p in parted.parameters()] == [1] * 6  # what the old grouping read
    assert [full_shape(p) for p in parted.parameters()] == [tuple(p.shape) for p in whole.parameters()]
    expected = _layout(build_optimizer(cfg, whole), {id(p): n for n, p in whole.named_parameters()})
    assert expected == [(0.5, ["0.weight", "2.weight"]), (0.0, ["0.bias", "1.weight", "1.bias", "2.bias"])]
    assert _layout(build_optimizer(cfg, parted), {id(p): n for n, p in parted.named_parameters()}) == expected
    row = dataclasses.replace(SUPPORTED_MODELS["llama"], freeze_groups={"first": ("0",)})
    assert freeze(parted, row, ["first"]) == 16 == full_numel(parted[0].weight) + 4
    assert parameter_counts(parted) == (18, 34) == (sum(p.numel() for p in whole.parameters()) - 16, 34)
