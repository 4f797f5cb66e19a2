"""The Accelerator for a recipe. Backend-specific setup lives here, in one small place.

This release runs one process (CPU or one GPU) and plain data parallelism; mixed precision is handled by
:mod:`finetune.precision`, not by accelerate (whose fp16 is silently fp32 on CPU), so the Accelerator is always
created with ``mixed_precision="no"`` and ``gradient_accumulation_steps=1`` (the loop accumulates itself).
"""

from __future__ import annotations

from typing import Any

import torch

from finetune.config import RecipeConfig


def make_accelerator(cfg: RecipeConfig) -> Any:
    """An Accelerator on the GPU when there is one, else on the CPU (gloo when distributed)."""
    from accelerate import Accelerator

    del cfg  # backend selection from launch.accelerate_config arrives with the distributed release
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no", gradient_accumulation_steps=1)
