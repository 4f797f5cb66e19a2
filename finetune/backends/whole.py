"""Whole-model backends: one process, or DDP (one whole copy of the model per rank). Every tensor is whole, so
their checkpoints move between the two and any world size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from finetune.backends.base import Backend, Sharding, alone

T = TypeVar("T")


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

    def pick(self, *, whole: T, fsdp: T, deepspeed: T) -> T:
        return whole

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

    @property
    def keeps_gradient_buckets(self) -> bool:
        return not self.single_process

    def split_over(self, world: int, num_machines: int) -> Sharding:
        if self.single_process or world == 1:
            return alone()
        return Sharding(self.name, self.kind, world, 1, 1, 1, engine=self,
                        description=f"DDP over {world} processes: nothing sharded, "
                        "gradient buckets hold a second copy of the gradients")
