"""finetune.runtime.precision on one process (no backend): which forward passes autocast, which scaler each
``train.mixed_precision`` gets, and what a step through it reports; and under the sharding backends (no process
group needed): who casts (autocast off where FSDP's policy or DeepSpeed's engine casts the weights), which grad
scaler fp16 gets, the warning for 16-bit weights with no fp32 master copy. The policy each FSDP version gets is
test_fsdp.py's; tests/distributed/test_fsdp_precision.py shows it in effect on 2 processes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from finetune.backends import Backend, backend_named
from finetune.runtime.precision import NoScaler, Precision, master_weights_warning


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


FSDP1, FSDP2 = backend_named("fsdp1"), backend_named("fsdp2")
ZERO2, DDP = backend_named("zero2"), backend_named("ddp")


def _autocast_on(precision: Precision) -> bool:
    with precision.autocast():
        return torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("backend", [FSDP1, FSDP2, ZERO2], ids=lambda b: b.name)
def test_no_autocast_where_the_backend_casts(backend: Backend) -> None:
    assert not _autocast_on(Precision("bf16", "cpu", backend))  # the policy (or the engine) casts: no double cast


@pytest.mark.parametrize("backend", [None, DDP, backend_named("single")], ids=str)
def test_autocast_where_weights_stay_fp32(backend: Backend | None) -> None:
    assert _autocast_on(Precision("bf16", "cpu", backend))


def test_fp16_scalers() -> None:
    """FSDP1's flat shards differ per rank: its scaler all-reduces the overflow check. FSDP2's DTensor gradients
    already do that inside torch's plain scaler. DeepSpeed scales itself."""
    assert isinstance(Precision("fp16", "cpu", FSDP1).scaler, ShardedGradScaler)
    fsdp2 = Precision("fp16", "cpu", FSDP2).scaler
    assert isinstance(fsdp2, torch.amp.GradScaler) and not isinstance(fsdp2, ShardedGradScaler)
    assert isinstance(Precision("fp16", "cpu", ZERO2).scaler, NoScaler)
    assert isinstance(Precision("bf16", "cpu", FSDP1).scaler, NoScaler)


def test_warning_for_16_bit_weights_without_fp32_master_copy() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    for backend in (backend_named("single"), DDP, FSDP2):
        warning = master_weights_warning(model, backend)
        assert warning is not None and warning.startswith("warning: model.dtype=bfloat16: 30 trainable parameters")
        assert "no fp32 master copy" in warning and "model.dtype=float32" in warning
    assert master_weights_warning(model, ZERO2) is None  # DeepSpeed keeps fp32 master weights itself
    model.requires_grad_(False)
    assert master_weights_warning(model, FSDP2) is None  # frozen weights are never updated
    assert master_weights_warning(torch.nn.Linear(4, 4), FSDP2) is None
