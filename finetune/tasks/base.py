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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from finetune.config.schema import RecipeConfig
from finetune.data import DataBundle
from finetune.data.batching import Collator, PackingCollator, PreferenceCollator, StreamSampler, eval_shard
from finetune.registry import SupportedModel, recipe_row
from finetune.tasks.logprobs import Forward


@dataclass
class EvalCounts:
    """Sums over one eval batch: loss over ``num_tokens`` targets, per metric (correct, total), and per named
    mean (sum, count): the loop logs ``eval_<name>`` = sum / count over the whole eval set (e.g. a mean reward
    margin per pair). A task lists its mean names in ``eval_means`` so every rank reduces the same vector."""

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    correct: dict[str, torch.Tensor] = field(default_factory=dict)
    total: dict[str, torch.Tensor] = field(default_factory=dict)
    means: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class Task(Protocol):
    """Everything the loop, the worker and ``finetune eval`` ask of a task, so that none of them names a task
    class: the data it reads, a preparation step before training or evaluation, its dataloaders, the target
    counts and outputs the loop reduces, and what the eval metrics mean."""

    data: DataBundle
    """The tokenized splits (the worker reads probe inputs and the classification labels from them)."""

    eval_means: tuple[str, ...]
    """The names of the :attr:`EvalCounts.means` this task reports, in the order every rank reduces them."""

    eval_loss: bool
    """Whether the task has an eval loss at all (GRPO's eval generates and scores: no loss, so none is logged)."""

    perplexity: bool
    """Whether the eval loss is a per-token negative log-likelihood, so that ``exp(eval_loss)`` is a perplexity."""

    adds_router_loss: bool
    """Whether :meth:`train_output` adds a mixture-of-experts model's router load-balancing loss (the SFT tasks:
    finetune.tasks.router); the others train without it and the run says so in train.log."""

    def prepare(self, initial: Callable[[], Any], accelerator: Any, precision: Any, log: Callable[[str], None],
                splits: tuple[str, ...] = ("train", "eval")) -> None:
        """Work on the initial model before the first step or eval pass, on every rank (DPO scores its reference
        log-probs here, before a resume loads a checkpoint); ``initial()`` returns that model, called only by a
        task that needs it. ``splits``: the splits the run will read."""
        ...

    def build_dataloader(self, split: str, start_sample: int = 0) -> Iterable[dict[str, Any]]: ...

    def count_targets(self, batch: dict[str, Any]) -> int:
        """The number of targets :meth:`train_output` sums its loss over (host tensors, before the forward)."""
        ...

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The loss summed over the micro-batch's targets (a 0-d tensor with grad)."""
        ...

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts: ...

    def count_samples(self, batch: dict[str, Any]) -> int:
        """The samples an eval batch holds (a preference batch holds two sequences per sample)."""
        ...

    @property
    def checkpoint_objects(self) -> dict[str, Any]:
        """Name -> object with ``state_dict()`` / ``load_state_dict()`` that a checkpoint must hold besides the
        model (GRPO: a generation batch that later steps still use); the worker adds them to ``Trainer.objects``."""
        ...

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Task metrics of the step just taken, for its train row, on every rank after each step; ``reduce``
        sums a tensor over ranks (a collective: a task calls it the same number of times on every rank)."""
        ...


class TaskData:
    """Dataloaders shared by every task: the endless resumable train stream and the exact eval shard.

    ``eval_means``: the names of the :attr:`EvalCounts.means` this task reports (none here)."""

    eval_means: tuple[str, ...] = ()
    eval_loss = True  # every task but GRPO reports a loss on the eval set
    perplexity = True  # the eval loss is a per-token (or per-label) NLL: exp(eval_loss) is logged as eval_ppl
    adds_router_loss = False  # only the SFT tasks add an MoE router's aux loss (finetune.tasks.router)

    def count_samples(self, batch: dict[str, Any]) -> int:
        """One sample per row of the batch."""
        return len(batch["input_ids"])

    @property
    def checkpoint_objects(self) -> dict[str, Any]:
        """Nothing to checkpoint besides the model: the data cursor is the loop's."""
        return {}

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """No task metrics in the train row (and no collective)."""
        return {}

    def prepare(self, initial: Callable[[], Any], accelerator: Any, precision: Any, log: Callable[[str], None],
                splits: tuple[str, ...] = ("train", "eval")) -> None:
        """Nothing to prepare: the task reads only its data (see :meth:`Task.prepare`)."""

    def __init__(self, cfg: RecipeConfig, data: DataBundle, pad_id: int, rank: int, world: int,
                 with_prompts: bool = False, lockstep: bool = False, row: SupportedModel | None = None) -> None:
        """``lockstep``: parameters are sharded, so every rank must run the same number of eval forward passes.
        ``row``: the recipe's row, as the worker resolved it (build_task hands it on); a hand-made config of the
        task's own fields (no ``model``, tests) has none, and a task then assumes a Hugging Face model."""
        self.cfg, self.data, self.pad_id, self.rank, self.world = cfg, data, pad_id, rank, world
        self.with_prompts, self.lockstep = with_prompts, lockstep
        if row is None and getattr(cfg, "model", None) is not None:
            row = recipe_row(cfg)  # a task built without build_task (tests): resolved here, once
        self.row = row
        self.forward = Forward.of(row)  # how its training forward calls the model (tasks.logprobs)

    def build_dataloader(self, split: str, start_sample: int = 0) -> Iterable[dict[str, Any]]:
        """``train``: this rank's micro-batches from stream position ``start_sample``; ``eval``: its shard."""
        if split == "train" and self.data.stream is not None:  # data.streaming: the stream holds its own cursor
            options = self.loader_options()  # a worker: one process tokenizes ahead, the cursor stays exact
            return self.data.stream.batches(rank=self.rank, world=self.world, micro=self.cfg.train.micro_batch_size,
                                            global_batch=self.cfg.train.global_batch_size,
                                            collate=self.train_collator(), ahead=options.get("num_workers", 0) > 0)
        if split == "train":
            assert self.data.train is not None
            dataset = self.data.train.dataset.with_format(None)
            sampler = StreamSampler(
                len(dataset), global_batch=self.cfg.train.global_batch_size,
                micro_batch=self.cfg.train.micro_batch_size, rank=self.rank, world=self.world,
                seed=self.cfg.train.seed, shuffle=self.cfg.data.shuffle, start_sample=start_sample,
                mixture=self.data.mixture,
            )
            collate = self.train_collator()
            # own generator: creating the iterator must not draw from the global RNG (exact resume of dropout)
            return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, generator=torch.Generator(),
                              **self.loader_options())
        assert split == "eval" and self.data.eval is not None
        full = self.data.eval.dataset
        collate = self.eval_collator()
        shard = full.select(eval_shard(len(full), self.rank, self.world))
        loader = DataLoader(shard, batch_size=self.cfg.eval.batch_size, shuffle=False, drop_last=False,
                            collate_fn=collate, generator=torch.Generator(), **self.loader_options())
        if not self.lockstep:
            return loader
        # rank 0 holds the largest shard; the others pad with marked filler batches that count nothing
        batches = math.ceil(math.ceil(len(full) / self.world) / self.cfg.eval.batch_size)
        return _padded(loader, batches, lambda: {**collate([full[0]]), "filler": True})

    def loader_options(self) -> dict[str, Any]:
        """Worker processes and pinned memory (``data.num_workers``; null: 2 and pinned on CUDA, none on the CPU).
        Workers only collate the batches the sampler names, in its order, so the data order, the cursor and exact
        resume do not depend on them; collating uses no random numbers."""
        cuda = torch.cuda.is_available()
        workers = self.cfg.data.num_workers if self.cfg.data.num_workers is not None else (2 if cuda else 0)
        if workers == 0:
            return {"pin_memory": cuda}
        return {"num_workers": workers, "pin_memory": cuda, "prefetch_factor": 2, "persistent_workers": False}

    def train_collator(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """How a training micro-batch's rows become tensors: padded, or packed with ``data.packing``."""
        return PackingCollator(self.cfg.data.pack_to_multiple_of, self.pad_id) if self.cfg.data.packing \
            else Collator(self.pad_id)

    def eval_collator(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """How an eval batch's rows become tensors (padded; with left-padded prompts for generation)."""
        return Collator(self.pad_id, with_prompts=self.with_prompts)

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


class PairTask(TaskData):
    """What every preference-pair task shares (``data.format: preference``): a target and a sample is a pair, and a
    micro-batch of B pairs is one batch of 2B sequences (:class:`PreferenceCollator`, chosen rows first). The eval
    loss is per pair, not per token, so no perplexity is logged."""

    perplexity = False

    def train_collator(self) -> PreferenceCollator:
        return PreferenceCollator(self.pad_id)

    def eval_collator(self) -> PreferenceCollator:
        return PreferenceCollator(self.pad_id)

    def count_targets(self, batch: dict[str, Any]) -> int:
        """One target per pair."""
        return int(batch["pairs"])

    def count_samples(self, batch: dict[str, Any]) -> int:
        """One sample per pair."""
        return int(batch["pairs"])
