"""TrainState: the loop's own counters, saved in every checkpoint (accelerate saves none of them)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from finetune import objectives

if TYPE_CHECKING:
    from finetune.config import RecipeConfig


@dataclass
class TrainState:
    """Where training is. ``samples_seen`` (global, over all ranks) is the data cursor: with the dataset size it
    gives the epoch and the position in it, independent of world size and micro-batch size."""

    step: int = 0
    micro_step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    train_size: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    best_eval_loss: float = math.inf

    def advance(self, *, micro_steps: int, samples: int, tokens: int) -> None:
        """Count one optimizer step; ``epoch`` is the epoch the next sample belongs to."""
        self.step += 1
        self.micro_step += micro_steps
        self.samples_seen += samples
        self.tokens_seen += tokens
        self.epoch = self.samples_seen // self.train_size if self.train_size else 0  # 0: a stream (no epochs)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def steps_per_batch(cfg: RecipeConfig) -> int:
    """Optimizer steps that one global batch of samples trains: ``grpo.iterations`` for a task whose record
    ``repeats_batches`` (grpo: one generation batch serves that many updates), else 1. Each step counts
    ``global_batch_size`` samples in ``samples_seen``."""
    record = objectives.objective(cfg.task)
    return cfg.grpo.iterations if record is not None and record.repeats_batches else 1


def epoch_samples(cfg: RecipeConfig, rows: int) -> int:
    """``samples_seen`` of one epoch (one pass over ``rows`` training rows): the rows, times
    :func:`steps_per_batch` (each row is counted at every step its batch trains). TrainState.train_size holds it,
    so that ``epoch = samples_seen // train_size`` is the pass over the rows whatever ``grpo.iterations`` is."""
    return rows * steps_per_batch(cfg)


def total_steps(cfg: RecipeConfig, train_size: int) -> int:
    """``train.max_steps``, or the steps that ``train.epochs`` passes over the training set take; ``train_size`` is
    :func:`epoch_samples`. With k = :func:`steps_per_batch` that is k x the global batches of the passes (rounded
    up to a whole batch), so a run ends at the end of a batch's k steps."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    assert cfg.train.epochs is not None, "the schema requires max_steps or epochs"
    k = steps_per_batch(cfg)
    return k * max(1, math.ceil(cfg.train.epochs * (train_size // k) / cfg.train.global_batch_size))
