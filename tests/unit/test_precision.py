"""finetune.runtime.precision on one process (no backend): which forward passes autocast, which scaler each
``train.mixed_precision`` gets, and what a step through it reports. The backends' share (who casts under FSDP and
DeepSpeed, their scalers, the fp32-master-copy warning) is test_fsdp_precision.py."""

from __future__ import annotations

import pytest
import torch

from finetune.runtime.precision import NoScaler, Precision


@pytest.mark.parametrize("mode,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", None)])
def test_forward_passes_autocast_to_the_mode(mode: str, dtype: torch.dtype | None) -> None:
    with Precision(mode, "cpu").autocast():
        assert torch.is_autocast_enabled("cpu") is (dtype is not None)
        if dtype is not None:
            assert torch.get_autocast_dtype("cpu") == dtype


def _model_and_optimizer(grad: float) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.full((2,), grad)
    return weight, torch.optim.SGD([weight], lr=0.5)


def test_bf16_steps_through_a_scaler_that_does_nothing() -> None:
    precision = Precision("bf16", "cpu")
    assert isinstance(precision.scaler, NoScaler) and precision.loss_scale is None
    assert not precision.absorbs_overflow()
    weight, optimizer = _model_and_optimizer(1.0)
    assert precision.step(optimizer)
    assert weight.tolist() == [0.5, 0.5]
    assert not precision.step(optimizer, apply=False)  # not finite: no update
    assert weight.tolist() == [0.5, 0.5]


def test_fp16_skips_an_overflowing_step_and_halves_its_scale() -> None:
    precision = Precision("fp16", "cpu")
    assert type(precision.scaler) is torch.amp.GradScaler and precision.loss_scale == 2.0 ** 16
    assert precision.absorbs_overflow()
    weight, optimizer = _model_and_optimizer(float("inf"))
    precision.scaler.scale(weight.sum())  # the scaler tracks the scaled loss's device
    assert not precision.step(optimizer)
    assert weight.tolist() == [1.0, 1.0] and precision.loss_scale == 2.0 ** 15
