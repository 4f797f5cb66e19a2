"""The seam between the shared loop and a task: three methods, and the counts they return.

The loop owns everything else (accumulation, precision, clipping, stepping, logging, checkpoints). A task
returns *sums* and *counts*, never means, so the loop can divide once over the whole accumulation window and
all ranks (token-weighted loss) and sum eval counts over ranks exactly. What a "target" is belongs to the task
(a next token, a class label, a preference pair): the loop asks the task to count the targets of each
micro-batch on the host before the forward passes, because the division must be known before the first
backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from finetune.config.schema import RecipeConfig
from finetune.data import DataBundle
from finetune.data.batching import Collator, PackingCollator, StreamSampler, eval_shard


@dataclass
class EvalCounts:
    """Sums over one eval batch: loss over ``num_tokens`` targets, and per metric (correct, total)."""

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    correct: dict[str, torch.Tensor] = field(default_factory=dict)
    total: dict[str, torch.Tensor] = field(default_factory=dict)


class Task(Protocol):
    """What the loop needs from a task."""

    def build_dataloader(self, split: str, start_sample: int = 0) -> Iterable[dict[str, Any]]: ...

    def count_targets(self, batch: dict[str, Any]) -> int:
        """The number of targets :meth:`train_output` sums its loss over (host tensors, before the forward)."""
        ...

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The loss summed over the micro-batch's targets (a 0-d tensor with grad)."""
        ...

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts: ...


class TaskData:
    """Dataloaders shared by every task: the endless resumable train stream and the exact eval shard."""

    def __init__(self, cfg: RecipeConfig, data: DataBundle, pad_id: int, rank: int, world: int,
                 with_prompts: bool = False, lockstep: bool = False) -> None:
        """``lockstep``: parameters are sharded, so every rank must run the same number of eval forward passes."""
        self.cfg, self.data, self.pad_id, self.rank, self.world = cfg, data, pad_id, rank, world
        self.with_prompts, self.lockstep = with_prompts, lockstep

    def build_dataloader(self, split: str, start_sample: int = 0) -> Iterable[dict[str, Any]]:
        """``train``: this rank's micro-batches from stream position ``start_sample``; ``eval``: its shard."""
        if split == "train":
            assert self.data.train is not None
            dataset = self.data.train.dataset.with_format(None)
            sampler = StreamSampler(
                len(dataset), global_batch=self.cfg.train.global_batch_size,
                micro_batch=self.cfg.train.micro_batch_size, rank=self.rank, world=self.world,
                seed=self.cfg.train.seed, shuffle=self.cfg.data.shuffle, start_sample=start_sample,
            )
            collate = PackingCollator() if self.cfg.data.packing else Collator(self.pad_id)
            # own generator: creating the iterator must not draw from the global RNG (exact resume of dropout)
            return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, generator=torch.Generator())
        assert split == "eval" and self.data.eval is not None
        full = self.data.eval.dataset
        collate = Collator(self.pad_id, with_prompts=self.with_prompts)
        shard = full.select(eval_shard(len(full), self.rank, self.world))
        loader = DataLoader(shard, batch_size=self.cfg.eval.batch_size, shuffle=False, drop_last=False,
                            collate_fn=collate, generator=torch.Generator())
        if not self.lockstep:
            return loader
        # rank 0 holds the largest shard; the others pad with marked filler batches that count nothing
        batches = math.ceil(math.ceil(len(full) / self.world) / self.cfg.eval.batch_size)
        return _padded(loader, batches, lambda: {**collate([full[0]]), "filler": True})

    def eval_size(self) -> int:
        """Samples in the whole eval set (all ranks)."""
        return len(self.data.eval.dataset) if self.data.eval is not None else 0


def _padded(loader: Iterable[dict[str, Any]], total: int, filler: Any) -> Iterator[dict[str, Any]]:
    """``loader``'s batches, then filler batches up to ``total``."""
    count = 0
    for batch in loader:
        count += 1
        yield batch
    for _ in range(total - count):
        yield filler()
