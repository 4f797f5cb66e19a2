"""finetune.storage.checkpoints: our own state files (JSON with any tensors in safetensors) round-trip exactly and
refuse what is not data. DCP's checkpoint metadata (read by a plain pickle.load) is test_fsdp.py's."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

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


def test_an_object_that_is_not_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cannot store object"):
        write_state(tmp_path, "bad", {"x": object()})
