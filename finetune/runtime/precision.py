"""Mixed precision owned by us, identical on CPU and GPU.

accelerate's ``fp16`` on CPU silently trains in fp32 (see docs/platform-notes.md), so the loop uses
``torch.autocast`` and, for fp16, a real ``torch.amp.GradScaler`` with dynamic loss scaling. ``bf16`` and ``no``
get a no-op scaler, so the loop has no precision branches.

The backend decides who casts (finetune.backends): DeepSpeed's engine casts and scales itself; FSDP's
mixed-precision policy casts the weights (autocast stays off: no double casting) while fp16 still gets our scaler,
sharded under FSDP1. Losses are computed in fp32 from 16-bit logits by the tasks (finetune.tasks.losses).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from finetune.backends import Backend

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

    def __init__(self, mode: str, device_type: str, backend: Backend | None = None) -> None:
        """``backend`` (None: one process, or a whole model per process) says who casts: its engine casts and
        scales itself (DeepSpeed; we then do neither), or it casts the weights (FSDP; no autocast, our scaler)."""
        self.mode, self.device_type = mode, device_type
        engine_owned = backend is not None and backend.engine_owns_precision
        casts = backend is not None and backend.casts_parameters
        self.dtype = None if engine_owned or casts else AUTOCAST_DTYPES.get(mode)
        self.scaler: Any = NoScaler()
        if mode == "fp16" and not engine_owned:
            if backend is not None and backend.sharded_scaler:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # lazy: heavy

                self.scaler = ShardedGradScaler(device_type)
            else:
                self.scaler = torch.amp.GradScaler(device_type)

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


def master_weights_warning(model: Any, backend: Backend) -> str | None:
    """A warning line when the optimizer will update 16-bit weights with no fp32 master copy (``model.dtype``
    bfloat16/float16 without a backend that keeps one): each update is rounded to the weight's 8 (bf16) or 11 (fp16)
    significant bits, so updates smaller than about 1/256 (1/2048) of a weight are lost and training stalls."""
    if backend.keeps_fp32_master_weights:
        return None
    half = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    counts: dict[str, int] = {}
    for p in model.parameters():
        if p.requires_grad and p.dtype in half:
            counts[half[p.dtype]] = counts.get(half[p.dtype], 0) + p.numel()
    if not counts:
        return None
    dtype = max(counts, key=counts.__getitem__)
    lost = "1/256" if dtype == "bfloat16" else "1/2048"
    return (f"warning: model.dtype={dtype}: {sum(counts.values())} trainable parameters are stored and updated in "
            f"{dtype} with no fp32 master copy, so updates smaller than about {lost} of a weight are rounded away "
            "(training stalls or drifts); for 16-bit compute with fp32 master weights use model.dtype=float32 with "
            "train.mixed_precision=bf16")
