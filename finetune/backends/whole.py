"""Whole-model backends: one process, or DDP (one whole copy of the model per rank). Every tensor is whole, so
their checkpoints move between the two and any world size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.backends.base import Backend, Sharding, alone
from finetune.backends.fullstate import ReadState, by_name, load_torch, strip_prefix


@dataclass(frozen=True)
class WholeModel(Backend):
    """``single`` (no launcher, one process) or ``ddp`` (DistributedDataParallel)."""

    kind: str = "single"  # "single" | "ddp"

    @classmethod
    def from_name(cls, name: str) -> WholeModel | None:
        return cls(name) if name in ("single", "ddp") else None

    @property
    def name(self) -> str:
        return self.kind

    @property
    def launcher_config(self) -> str:
        return "cpu" if self.single_process else self.name

    @property
    def whole_tensors(self) -> bool:
        return True

    @property
    def single_process(self) -> bool:
        return self.kind == "single"

    @property
    def weight_distribution(self) -> str:
        return "everywhere" if self.single_process else "broadcast"

    @property
    def sharding_text(self) -> str:
        return "whole tensors"

    @property
    def format_text(self) -> str:
        return "model.safetensors + optimizer.bin"

    def read_full_state(self, ckpt: Path, groups: list[list[str]] | None, scratch: Path | None) -> ReadState:
        """``model.safetensors`` (adapter-only for LoRA) and ``optimizer.bin`` (state by index, re-keyed by the
        parameter names in ``groups``). Nothing to convert: ``scratch`` is unused."""
        import torch  # lazy: heavy
        from safetensors.torch import load_file  # lazy: heavy

        model = strip_prefix(load_file(str(ckpt / "model.safetensors")), "module.")
        if groups is None:
            return model, None
        optim = torch.load(ckpt / "optimizer.bin", map_location="cpu", weights_only=True)  # safe: data only
        return model, by_name(optim, groups, ckpt / "optimizer.bin")

    def load_full_state(self, accelerator: Any, model: Any, optimizer: Any, full: dict[str, Any],
                        optim: dict[str, Any], *, adapter_only: bool) -> None:
        """torch.distributed.checkpoint's full-state-dict setters (:func:`~finetune.backends.fullstate.load_torch`)."""
        load_torch(model, optimizer, full, optim, accelerator.unwrap_model(model), adapter_only)

    @property
    def keeps_gradient_buckets(self) -> bool:
        return not self.single_process

    def split_over(self, world: int, num_machines: int) -> Sharding:
        if self.single_process or world == 1:
            return alone()
        return Sharding(self.name, self.kind, world, 1, 1, 1, engine=self,
                        description=f"DDP over {world} processes: nothing sharded, "
                        "gradient buckets hold a second copy of the gradients")
