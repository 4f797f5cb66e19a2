"""Mixed precision owned by us, identical on CPU and GPU.

accelerate's ``fp16`` on CPU silently trains in fp32 (see docs/platform-notes.md), so the loop uses
``torch.autocast`` and, for fp16, a real ``torch.amp.GradScaler`` with dynamic loss scaling. ``bf16`` and ``no``
get a no-op scaler, so the loop has no precision branches.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class NoScaler:
    """The scaler of bf16/fp32 training: scales by 1 and never skips a step."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: Any) -> None:
        return None

    def step(self, optimizer: Any) -> None:
        optimizer.step()

    def update(self) -> None:
        return None

    def get_scale(self) -> float:
        return 1.0

    def is_enabled(self) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class Precision:
    """Autocast context and grad scaler for ``train.mixed_precision``."""

    def __init__(self, mode: str, device_type: str, engine_owned: bool = False) -> None:
        """``engine_owned``: the backend engine (DeepSpeed) casts and scales itself; we then do neither."""
        self.mode, self.device_type = mode, device_type
        self.dtype = None if engine_owned else AUTOCAST_DTYPES.get(mode)
        self.scaler: Any = torch.amp.GradScaler(device_type) if mode == "fp16" and not engine_owned else NoScaler()

    def autocast(self) -> contextlib.AbstractContextManager:
        """Forward passes run under this context."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def step(self, optimizer: Any, apply: bool = True) -> bool:
        """Optimizer step through the scaler (none when ``apply`` is False: the gradients are not finite); False
        when no update was made (not applied, or fp16 overflowed and the scaler skipped it)."""
        before = self.scaler.get_scale()
        if apply:
            self.scaler.step(optimizer)
        self.scaler.update()  # also after a skip: an fp16 overflow halves the scale
        return apply and not self.scaler.get_scale() < before

    def absorbs_overflow(self) -> bool:
        """Whether fp16's dynamic loss scale explains a non-finite gradient: the scaler (ours, or DeepSpeed's when
        the engine owns precision) skips the step and lowers the scale. Once our scale is below 1 the gradients
        overflow without any scaling, which is a divergence."""
        return self.mode == "fp16" and (self.loss_scale is None or self.loss_scale >= 1.0)

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (fp16 only)."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else None
