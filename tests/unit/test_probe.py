"""finetune.artifacts.probe: the logit probe a checkpoint records (the live model's logits, its state files, a damaged
one) and the tolerance `finetune export` verifies an export against. The layout a manifest records is
test_layout.py; where an export may be written, test_export.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.artifacts import probe
from finetune.errors import RunDirError


def test_the_probe_records_the_live_logits_and_restores_train_mode(llama: Any) -> None:
    """state_dict() gives the model's own logits on the probe inputs (fp32, CPU), computed without dropout (eval
    mode) and without building a graph; the model is left in the mode it was in; the inputs are made once."""
    made = []

    def inputs() -> dict[str, Any]:
        made.append(1)
        return {"input_ids": torch.tensor([[1, 5, 9, 4], [1, 7, 3, 0]]),
                "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])}

    recorder = probe.LogitProbe(llama, torch.device("cpu"), inputs)
    llama.train()
    first = recorder.state_dict()
    assert llama.training, "the probe must give the model back in train mode"
    llama.eval()
    second = recorder.state_dict()
    assert not llama.training
    assert made == [1]
    assert set(first) == set(probe.KEYS) and first["logits"].dtype == torch.float32
    assert not first["logits"].requires_grad
    with torch.no_grad():
        expected = llama(**inputs()).logits.float()
    assert torch.equal(first["logits"], expected) and torch.equal(second["logits"], expected)
    recorder.load_state_dict({"anything": 1})  # resuming restores nothing from it
    assert probe.LogitProbe.optional_in_checkpoint  # checkpoints written before probes existed still resume


def test_a_probe_round_trips_through_the_checkpoint_state_files(llama: Any, tmp_path: Path) -> None:
    """What the worker checkpoints (checkpoints.write_state) is what probe.read gives back; no probe: None."""
    from finetune.storage.checkpoints import write_state

    assert probe.read(tmp_path) is None
    inputs = {"input_ids": torch.tensor([[1, 5, 9]]), "attention_mask": torch.tensor([[1, 1, 1]])}
    state = probe.LogitProbe(llama, torch.device("cpu"), lambda: inputs).state_dict()
    write_state(tmp_path, probe.NAME, state)
    got = probe.read(tmp_path)
    assert got is not None and got.recorded and got.tokens == 3
    assert all(torch.equal(got.tensors()[k], state[k]) for k in probe.KEYS)


@pytest.mark.parametrize("damage", ["json", "tensors", "keys"])
def test_a_damaged_probe_is_one_line_about_the_checkpoint(tmp_path: Path, damage: str) -> None:
    from finetune.storage.checkpoints import write_state

    write_state(tmp_path, probe.NAME, {"input_ids": torch.zeros(1, 2), "attention_mask": torch.ones(1, 2),
                                        "logits": torch.zeros(1, 2, 3)})
    if damage == "json":
        (tmp_path / "probe.json").write_bytes(b"\x80\x04not json")
    elif damage == "tensors":
        (tmp_path / "probe.safetensors").write_bytes(b"garbage")
    else:
        (tmp_path / "probe.json").write_text(json.dumps({"__dict__": {"logits": 1}}))
    with pytest.raises(RunDirError, match="probe") as info:
        probe.read(tmp_path)
    assert "\n" not in str(info.value)


def test_max_delta_never_accepts_another_shape_or_nan() -> None:
    a = torch.zeros(2, 3)
    assert probe.max_delta(a, a) == 0.0
    assert probe.max_delta(a + 0.5, a) == pytest.approx(0.5)
    assert probe.max_delta(torch.zeros(3, 2), a) == float("inf")
    assert probe.max_delta(torch.full((2, 3), float("nan")), a) == float("inf")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("quantized", [False, True])
def test_the_tolerance_is_finetune_merges(dtype: str, quantized: bool) -> None:
    """The export check accepts what `finetune merge`'s check accepts (one policy, kept equal here)."""
    from finetune.commands.merge import tolerance

    assert probe.tolerance(dtype, "no", "fsdp2", quantized) == tolerance(dtype, quantized)
    assert probe.tolerance(dtype, "bf16", "ddp", quantized) == tolerance(dtype, quantized, "bf16")


def test_deepspeed_with_half_precision_gets_the_half_precision_tolerance() -> None:
    """DeepSpeed's engine computed the recorded logits with 16-bit weights; the export holds its fp32 masters."""
    assert probe.tolerance("float32", "bf16", "zero3", False) == probe.tolerance("bfloat16", "no", "single", False)
    assert probe.tolerance("float32", "no", "zero3", False) < probe.tolerance("float32", "bf16", "zero3", False)
