"""What the unit tests of finetune.backends share: the backends' names (tests/unit/test_backends.py goes over every
one) and the smallest recipe with ``launch`` keys of a test's choosing (the timeout every backend passes on)."""

from __future__ import annotations

from typing import Any

from finetune.config import RecipeConfig

NAMES = ["single", "ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3", "zero3_offload"]


def recipe(**launch: Any) -> RecipeConfig:
    """A valid recipe (tiny-llama, one step, one sample per step) with these ``launch`` keys; no file is read."""
    return RecipeConfig.model_validate({
        "name": "t", "model": {"type": "tiny-llama"}, "data": {"format": "alpaca", "train": "x.jsonl"},
        "train": {"max_steps": 1, "micro_batch_size": 1, "global_batch_size": 1}, "launch": launch})
