"""Mixed precision owned by us, identical on CPU and GPU.

accelerate's ``fp16`` on CPU silently trains in fp32 (see ENV-NOTES.md), so the loop uses ``torch.autocast`` and,
for fp16, a real ``torch.amp.GradScaler`` with dynamic loss scaling. ``bf16`` and ``no`` get a no-op scaler, so
the loop has no precision branches.
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

    def step(self, optimizer: Any) -> bool:
        """Optimizer step through the scaler; False when fp16 overflowed and the step was skipped."""
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return not self.scaler.get_scale() < before

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (fp16 only)."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else None
