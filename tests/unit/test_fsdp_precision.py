"""Mixed precision under the sharding backends (the pieces that need no process group): who casts (autocast off where
FSDP's policy or DeepSpeed's engine casts the weights), which grad scaler fp16 gets, the warning for 16-bit weights
with no fp32 master copy, and whether the worker keeps FSDP's unsharded gradients across a window. The policy each
FSDP version gets is test_fsdp.py's; tests/distributed/test_fsdp_precision.py shows it in effect on 2 processes."""

from __future__ import annotations

import types

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from finetune.backends import Backend, backend_named
from finetune.runtime import plan, worker
from finetune.runtime.precision import NoScaler, Precision, master_weights_warning

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


def test_the_plan_decides_whether_unsharded_gradients_fit(monkeypatch) -> None:
    """On GPUs the worker asks finetune.runtime.plan about the smallest visible device; on the CPU, without accumulation
    or without an answer it reduce-scatters every micro-step."""
    accumulating, once = types.SimpleNamespace(grad_accum=2), types.SimpleNamespace(grad_accum=1)
    assert worker.fsdp_accumulation(accumulating, FSDP2) == FSDP2  # this CPU machine: no question asked
    asked: list[int] = []
    answer = {"fits": True}

    def fits(cfg: object, device_bytes: int) -> bool:
        asked.append(device_bytes)
        if answer["fits"] is None:
            raise RuntimeError("no plan for this model")
        return answer["fits"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plan, "visible_devices", lambda: [("cuda:0", 80 << 30), ("cuda:1", 40 << 30)])
    monkeypatch.setattr(plan, "unsharded_accumulation_fits", fits, raising=False)
    assert not worker.fsdp_accumulation(accumulating, FSDP1).syncs_each_micro_step
    answer["fits"] = False
    assert worker.fsdp_accumulation(accumulating, FSDP2).syncs_each_micro_step
    answer["fits"] = None
    assert worker.fsdp_accumulation(accumulating, FSDP2).syncs_each_micro_step
    assert asked == [40 << 30] * 3
    assert worker.fsdp_accumulation(once, FSDP2) == FSDP2 and worker.fsdp_accumulation(accumulating, DDP) == DDP
    assert len(asked) == 3
