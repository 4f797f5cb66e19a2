"""finetune.storage.state: the loop's counters a checkpoint saves, and how many optimizer steps a recipe trains.

``epoch`` is the pass over the training rows that the next sample belongs to (``samples_seen // train_size``),
whatever ``grpo.iterations`` is; a run of ``train.epochs`` ends at the end of a whole (GRPO: k-step) batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from finetune.storage.state import TrainState, epoch_samples, steps_per_batch, total_steps


def _cfg(task: str = "sft", iterations: int = 1, max_steps: int | None = None, epochs: float | None = None,
         global_batch_size: int = 4) -> SimpleNamespace:
    """The recipe fields these functions read."""
    return SimpleNamespace(task=task, grpo=SimpleNamespace(iterations=iterations),
                           train=SimpleNamespace(max_steps=max_steps, epochs=epochs,
                                                 global_batch_size=global_batch_size))


def test_advance_counts_a_step_and_the_epoch_of_the_next_sample() -> None:
    state = TrainState(train_size=10)
    for _ in range(2):
        state.advance(micro_steps=2, samples=4, tokens=100)
    assert (state.step, state.micro_step, state.samples_seen, state.tokens_seen, state.epoch) == (2, 4, 8, 200, 0)
    state.advance(micro_steps=2, samples=4, tokens=100)
    assert state.samples_seen == 12 and state.epoch == 1
    stream = TrainState()  # train_size 0: a stream has no epochs
    stream.advance(micro_steps=1, samples=4, tokens=1)
    assert stream.epoch == 0


def test_the_state_round_trips_through_its_dict() -> None:
    state = TrainState(step=3, micro_step=6, epoch=1, samples_seen=12, train_size=10, tokens_seen=300, elapsed_s=1.5,
                       best_eval_loss=0.25)
    saved = state.state_dict()
    assert saved == {"step": 3, "micro_step": 6, "epoch": 1, "samples_seen": 12, "train_size": 10,
                     "tokens_seen": 300, "elapsed_s": 1.5, "best_eval_loss": 0.25}
    fresh = TrainState()
    assert fresh.best_eval_loss == math.inf
    fresh.load_state_dict(saved)
    assert fresh == state


@pytest.mark.parametrize("cfg,rows,steps", [
    (_cfg(max_steps=7, epochs=None), 10, 7),          # max_steps wins, whatever the data
    (_cfg(epochs=2), 10, 5),                           # 20 samples in batches of 4: 5 steps
    (_cfg(epochs=1), 10, 3),                           # 10 samples: 2.5 batches, rounded up to 3
    (_cfg(epochs=0.01), 10, 1),                        # never fewer than one step
    (_cfg(task="grpo", iterations=2, epochs=2), 10, 10),  # 5 generation batches, 2 updates each
], ids=["max_steps", "two_epochs", "rounded_up", "at_least_one", "grpo_iterations"])
def test_total_steps(cfg: SimpleNamespace, rows: int, steps: int) -> None:
    assert total_steps(cfg, epoch_samples(cfg, rows)) == steps


def test_each_row_counts_once_per_step_its_batch_trains() -> None:
    assert steps_per_batch(_cfg()) == 1 and epoch_samples(_cfg(), 10) == 10
    assert steps_per_batch(_cfg("grpo", iterations=3)) == 3 and epoch_samples(_cfg("grpo", iterations=3), 10) == 30
    assert steps_per_batch(_cfg("dpo", iterations=3)) == 1  # grpo.iterations counts only for task grpo
