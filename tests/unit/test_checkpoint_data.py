"""A checkpoint is data: our own state round-trips exactly through JSON + safetensors, and the one pickle a backend
format reads with plain ``pickle.load`` (torch.distributed.checkpoint's ``.metadata``) constructs only DCP's own
metadata records."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_loads_only_dcp_records(tmp_path: Path, monkeypatch) -> None:
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
