"""finetune.backends.fsdp without a second process: the mixed-precision policy each FSDP version gets, when FSDP
reduces gradients (every micro-step unless told the unsharded gradients fit), and the data-only reading of DCP's
checkpoint metadata. Who casts and which grad scaler fp16 gets under FSDP are test_precision.py's;
tests/distributed/test_fsdp_precision.py shows the policy in effect on 2 processes."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from finetune.backends import backend_named, fsdp_mixed_precision

FSDP1, FSDP2 = backend_named("fsdp1"), backend_named("fsdp2")
ZERO2, DDP = backend_named("zero2"), backend_named("ddp")


@pytest.mark.parametrize(("mode", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fsdp2_computes_in_half_and_reduces_in_fp32(mode: str, dtype: torch.dtype) -> None:
    policy = fsdp_mixed_precision(mode, 2)
    assert isinstance(policy, MixedPrecisionPolicy)
    assert policy.param_dtype == dtype and policy.reduce_dtype == torch.float32
    assert policy.output_dtype is None and policy.cast_forward_inputs  # losses upcast the logits themselves


@pytest.mark.parametrize(("mode", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fsdp1_computes_in_half_reduces_in_fp32_and_keeps_buffers(mode: str, dtype: torch.dtype) -> None:
    policy = fsdp_mixed_precision(mode, 1)
    assert isinstance(policy, MixedPrecision)
    assert policy.param_dtype == dtype and policy.reduce_dtype == torch.float32
    assert policy.buffer_dtype is None  # rotary frequencies stay fp32, as under autocast
    assert not policy.keep_low_precision_grads  # the optimizer sees fp32 gradients


@pytest.mark.parametrize("version", [1, 2])
def test_no_policy_without_mixed_precision(version: int) -> None:
    assert fsdp_mixed_precision("no", version) is None


def test_fsdp_reduces_every_micro_step_unless_told_the_unsharded_gradients_fit() -> None:
    assert FSDP1.syncs_each_micro_step and FSDP2.syncs_each_micro_step
    assert not backend_named("fsdp2").with_unsharded_grads(True).syncs_each_micro_step
    assert not DDP.syncs_each_micro_step and not ZERO2.syncs_each_micro_step  # DDP's gradients are whole anyway


def test_unsharded_accumulation_is_an_fsdp_question() -> None:
    fsdp2 = backend_named("fsdp2")
    assert fsdp2.may_keep_unsharded_grads and fsdp2.asks_whether_unsharded_grads_fit
    told = fsdp2.with_unsharded_grads(True)
    assert not told.asks_whether_unsharded_grads_fit and not told.syncs_each_micro_step
    for name in ("single", "ddp", "zero2", "zero3"):
        backend = backend_named(name)
        assert not backend.may_keep_unsharded_grads and backend.with_unsharded_grads(True) is backend


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_loads_only_dcp_records(tmp_path: Path, monkeypatch) -> None:
    """The one pickle a backend format reads with plain ``pickle.load`` (torch.distributed.checkpoint's
    ``.metadata``) constructs only DCP's own metadata records."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from finetune.backends import restrict_dcp_metadata

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 500))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        restrict_dcp_metadata()
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.save(state, checkpoint_id=tmp_path / "ok")
        dcp.load(state, checkpoint_id=tmp_path / "ok")  # a real checkpoint still loads
        marker = tmp_path / "PWNED"
        (tmp_path / "ok" / ".metadata").write_bytes(pickle.dumps(_Payload(marker), protocol=4))
        with pytest.raises(BaseException, match="not allowed in checkpoint metadata"):
            dcp.load(state, checkpoint_id=tmp_path / "ok")
        assert not marker.exists()
    finally:
        dist.destroy_process_group()
