"""The loop's own rules, without a model: when periodic work is due, when a checkpoint is saved, and what the
Trainer holds (what moves during a run; the fixed facts are its frozen context)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from finetune.runtime import loop


@pytest.mark.parametrize(("step", "every", "due"), [(4, 2, True), (3, 2, False), (1, 1, True), (6, 4, False),
                                                    (4, None, False), (4, 0, False)])
def test_due_every_n_steps_and_never_without_an_interval(step: int, every: int | None, due: bool) -> None:
    assert loop._due(step, every) is due


def _trainer(step: int, every: int | None) -> tuple[Any, list[dict[str, Any]]]:
    logged: list[dict[str, Any]] = []
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(every_steps=every))
    tracker = SimpleNamespace(log=lambda kind, row: logged.append({"kind": kind, **row}))
    return SimpleNamespace(ctx=SimpleNamespace(cfg=cfg), state=SimpleNamespace(step=step), tracker=tracker), logged


@pytest.mark.parametrize(("step", "every", "last", "saved"), [
    (4, 2, False, True),   # on the interval
    (5, 2, False, False),  # between
    (5, 2, True, True),    # the last step, off the interval
    (5, None, True, False),  # checkpoints off: not even the last step
])
def test_a_checkpoint_is_saved_on_the_interval_and_at_the_last_step(step: int, every: int | None, last: bool,
                                                                     saved: bool) -> None:
    trainer, logged = _trainer(step, every)
    assert loop._save_due(trainer, last, collapsed=False) is saved
    assert logged == []


def test_a_collapsed_model_is_never_saved_and_the_log_says_so() -> None:
    trainer, logged = _trainer(4, 2)
    assert loop._save_due(trainer, last=True, collapsed=True) is False
    assert logged == [{"kind": "info", "message": "step 4: checkpoint not saved: the model looks collapsed"}]


def test_a_collapsed_step_off_the_interval_logs_nothing() -> None:
    trainer, logged = _trainer(5, 2)
    assert loop._save_due(trainer, last=False, collapsed=True) is False
    assert logged == []


def test_the_trainer_holds_only_what_moves_beside_its_context() -> None:
    assert [f.name for f in dataclasses.fields(loop.Trainer)] == [
        "ctx", "model", "optimizer", "scheduler", "precision", "task", "tracker", "state", "stop", "objects", "flops"]
