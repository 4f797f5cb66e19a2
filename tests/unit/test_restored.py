"""The restored-state judges on real torch objects (no run needed): a fp16 run's GradScaler and the loop's LambdaLR
state as torch writes them pass; each forged field is named. The end-to-end refusals (resume, one line, exit 2)
are tests/integration/test_safety.py::test_forged_restored_state_is_refused_in_one_line."""

from __future__ import annotations

import pytest
import torch

from finetune.storage import restored


def _scaler_state() -> dict:
    scaler = torch.amp.GradScaler("cpu")
    return scaler.state_dict()


def _scheduler_state(steps: int) -> dict:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler.state_dict()


def test_what_torch_writes_passes() -> None:
    built = _scaler_state()
    assert restored.scaler_problems(built, built) == []
    assert restored.scaler_problems({**built, "scale": 1024.0, "_growth_tracker": 7}, built) == []
    assert restored.scaler_problems(built, {}) == []  # an fp16 checkpoint resumed in bf16: the scaler ignores it
    assert restored.scaler_problems({}, {}) == []
    assert restored.scheduler_problems(_scheduler_state(3), 3, _scheduler_state(0)) == []


@pytest.mark.parametrize(("change", "needle"), [
    ({"scale": float("inf")}, "the loss scale is inf"),
    ({"scale": -2.0}, "the loss scale is -2.0"),
    ({"growth_interval": 1}, "growth_interval is 1, this run's is 2000"),
    ({"backoff_factor": 1.0}, "backoff_factor is 1.0"),
    ({"_growth_tracker": 5000}, "_growth_tracker is 5000"),
    ({"_growth_tracker": "0"}, "_growth_tracker is '0'"),
    ({"_scale": 1.0}, "other keys than a scaler's (_scale)"),
])
def test_a_forged_fp16_scaler_is_named(change: dict, needle: str) -> None:
    built = _scaler_state()
    found = restored.scaler_problems({**built, **change}, built)
    assert any(needle in line for line in found), found


def test_an_empty_scaler_state_for_an_fp16_run_is_named() -> None:
    assert restored.scaler_problems({}, _scaler_state()) == [
        "the loss scaler's state is empty, but this run scales its fp16 loss"]


@pytest.mark.parametrize(("change", "needle"), [
    ({"last_epoch": 4}, "has taken 4 steps, the loop 3"),
    ({"_step_count": 1}, "counts 1 calls, not 4"),
    ({"base_lrs": [1e-3]}, "base_lrs is [0.001], not 2 learning rates"),
    ({"_last_lr": [float("nan"), 1e-3]}, "_last_lr is [nan, 0.001]"),
    ({"lr_lambdas": [{"__code__": 1}, None]}, "lr_lambdas is"),
    ({"optimizer": None}, "other keys than a scheduler's (optimizer)"),
    ({"_get_lr_called_within_step": 1}, "_get_lr_called_within_step is 1, not a flag"),
])
def test_a_forged_scheduler_is_named(change: dict, needle: str) -> None:
    found = restored.scheduler_problems({**_scheduler_state(3), **change}, 3, _scheduler_state(0))
    assert any(needle in line for line in found), found


def _probe(**change: object) -> dict:
    """A logit probe as a checkpoint records it (2 x 3 token ids, their mask, 2 x 3 x 8 fp32 logits), changed."""
    return {"input_ids": torch.tensor([[1, 5, 7], [1, 2, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
            "logits": torch.randn(2, 3, 8), **change}


@pytest.mark.parametrize(("change", "needle"), [
    ({"input_ids": torch.tensor([[1, 5, 8], [1, 2, 0]])}, "token ids outside [0, 8)"),
    ({"input_ids": torch.tensor([[1, -5, 7], [1, 2, 0]])}, "token ids outside [0, 8)"),
    ({"input_ids": torch.tensor([[1.0, 5.0, 7.0], [1.0, 2.0, 0.0]])}, "not [rows, length] token ids"),
    ({"attention_mask": torch.tensor([[1, 1, 1]])}, "not 2 x 3 ones and zeros"),
    ({"attention_mask": torch.tensor([[1, 1, 2], [1, 1, 0]])}, "values other than 0 and 1"),
    ({"logits": torch.randn(2, 4, 8)}, "not 2 x 3 x vocabulary (or 2 x labels)"),
    ({"logits": torch.full((2, 3, 8), float("nan"))}, "not all finite"),
    ({"logits": [[1.0]]}, "holds no tensors"),
], ids=["id-at-the-vocabulary", "negative-id", "float-ids", "mask-shape", "mask-values",
        "logits-shape", "nan-logits", "not-a-tensor"])
def test_a_recorded_probe_is_checked_before_an_export_trusts_it(tmp_path, change: dict, needle: str) -> None:
    """The probe an export must reproduce (probe.json + .safetensors) is read back as what finetune records, or
    refused in one line naming probe.json as a damaged checkpoint (exit 2): a forged one reached the export's fresh
    process (an IndexError blamed on the export, exit 1) or its comparison (a mismatch "to report")."""
    from finetune.artifacts import probe
    from finetune.errors import RunDirError
    from finetune.storage.checkpoints import write_state

    for recorded in (_probe(), _probe(logits=torch.randn(2, 3))):  # a language model's; a classifier's scores
        write_state(tmp_path, probe.NAME, recorded)
        assert probe.read(tmp_path).tokens == 5
    write_state(tmp_path, probe.NAME, _probe(**change))
    with pytest.raises(RunDirError, match=r"probe\.json: the recorded probe is not one finetune records") as info:
        probe.read(tmp_path)
    assert needle in str(info.value) and "\n" not in str(info.value)
