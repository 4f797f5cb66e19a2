"""A checkpoint is data: our own state round-trips exactly through JSON + safetensors, and the one pickle a backend
format reads with plain ``pickle.load`` (torch.distributed.checkpoint's ``.metadata``) constructs only DCP's own
metadata records."""

from __future__ import annotations

import math
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.artifacts.checkpoint import rng_state, set_rng_state
from finetune.storage.checkpoints import read_state, write_state


def test_state_round_trips_exactly(tmp_path: Path) -> None:
    """Everything our checkpointed objects hold: tensors, tuples, int keys (optimizer state), numpy arrays (RNG),
    inf (best eval loss), nested lists and None."""
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreign": None}],
             "rng": ("MT19937", np.arange(5, dtype=np.uint32), 2, 0, 0.0), "best": math.inf, "worst": -math.inf}
    write_state(tmp_path, "obj", state)
    back = read_state(tmp_path, "obj")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["obj.json", "obj.safetensors"]
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["param_groups"] == state["param_groups"] and isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["rng"][0] == "MT19937" and back["rng"][1].dtype == np.uint32
    assert back["rng"][1].tolist() == [0, 1, 2, 3, 4]
    assert back["best"] == math.inf and back["worst"] == -math.inf


def test_rng_state_restores_every_generator(tmp_path: Path) -> None:
    write_state(tmp_path, "rng", rng_state())
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(read_state(tmp_path, "rng"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_an_object_that_is_not_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cannot store object"):
        write_state(tmp_path, "bad", {"x": object()})


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
