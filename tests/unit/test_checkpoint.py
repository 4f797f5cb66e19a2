"""finetune.artifacts.checkpoint on one CPU process: a saved checkpoint loads back the train state, the run's objects,
the model and every RNG; a failed write leaves nothing behind; rank 0's
publishing on a thread raises its failure where it is waited for."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from finetune.artifacts import checkpoint
from finetune.artifacts.checkpoint import rng_state, set_rng_state
from finetune.config import RecipeConfig
from finetune.errors import RunDirError
from finetune.registry import SUPPORTED_MODELS
from finetune.runtime.context import RunContext
from finetune.storage import rundir
from finetune.storage.checkpoints import read_state, write_state
from finetune.storage.state import TrainState


class _Cursor:
    """A checkpointed object of the run's (as a data stream's cursor is): a state dict and its loader."""

    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class _Full(_Cursor):
    def state_dict(self) -> dict[str, Any]:
        raise OSError(28, "No space left on device")


def _run(tmp_path: Path) -> tuple[RunContext, Any]:
    """A run context on one CPU process and its prepared 3 -> 2 linear model (weights all 0.5)."""
    from accelerate import Accelerator

    (tmp_path / "t.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    cfg = RecipeConfig.model_validate({"name": "r", "model": {"type": "tiny-llama"},
                                       "data": {"format": "alpaca", "train": str(tmp_path / "t.jsonl")},
                                       "train": {"max_steps": 6, "micro_batch_size": 1, "global_batch_size": 2},
                                       "checkpoint": {"every_steps": 3}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, 0.5)
    torch.nn.init.constant_(model.bias, 0.5)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokenizer = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    ctx = RunContext(cfg=cfg, run_dir=run_dir, run_id="run-1", row=SUPPORTED_MODELS["tiny-llama"],
                     labels=["neg", "pos"], backend=SimpleNamespace(name="single"), accelerator=accelerator,
                     tokenizer=tokenizer, max_steps=6)
    return ctx, model


def test_save_then_load_round_trips_state_objects_model_and_rng(tmp_path: Path) -> None:
    ctx, model = _run(tmp_path)
    state = TrainState(step=3, micro_step=6, epoch=1, samples_seen=6, train_size=4, tokens_seen=120, elapsed_s=2.5,
                       best_eval_loss=1.25)
    cursor = _Cursor(17)
    path = checkpoint.save(ctx, state, {"cursor": cursor})
    assert path == tmp_path / "run" / "checkpoints" / "step-000003" and path.is_dir()
    manifest = json.loads((path / rundir.MANIFEST).read_text())
    assert (manifest["step"], manifest["samples_seen"], manifest["run_id"]) == (3, 6, "run-1")
    assert (manifest["backend"], manifest["world_size"], manifest["labels"]) == ("single", 1, ["neg", "pos"])
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    with torch.no_grad():  # everything moves on after the save ...
        model.weight.zero_()
    cursor.position = 40
    random.random(), np.random.rand(), torch.rand(1)
    restored = TrainState(train_size=9)  # ... and a fresh build knows its own epoch size
    checkpoint.load(ctx.accelerator, path, restored, {"cursor": cursor})

    assert restored == TrainState(step=3, micro_step=6, epoch=1, samples_seen=6, train_size=9, tokens_seen=120,
                                  elapsed_s=2.5, best_eval_loss=1.25)
    assert cursor.position == 17
    assert model.weight.tolist() == [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected_draws


def test_a_failed_save_removes_its_partial_checkpoint(tmp_path: Path) -> None:
    ctx, _ = _run(tmp_path)
    with pytest.raises(RunDirError, match=r"cannot write checkpoint step-000003 \(OSError: No space left on device"):
        checkpoint.save(ctx, TrainState(step=3, samples_seen=6, train_size=4), {"cursor": _Full(1)})
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


def test_rng_state_restores_every_generator(tmp_path: Path) -> None:
    write_state(tmp_path, "rng", rng_state())
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(read_state(tmp_path, "rng"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_publishing_on_a_thread_raises_its_failure_when_waited_for() -> None:
    started, release = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        release.wait(10)

    publisher = checkpoint._Publisher()
    publisher.start(slow, background=True)
    assert started.wait(10)  # start() returned while the publish still runs: nobody waits for it
    release.set()
    publisher.wait()

    def broken() -> None:
        raise RunDirError("cannot write checkpoint step-000004")

    publisher.start(broken, background=True)
    with pytest.raises(RunDirError, match="step-000004"):
        publisher.wait()
    publisher.wait()  # raised once


def test_the_run_fails_when_its_last_checkpoint_could_not_be_published(monkeypatch) -> None:
    publisher = checkpoint._Publisher()
    monkeypatch.setattr(checkpoint, "_PUBLISHER", publisher)

    def broken() -> None:
        raise RunDirError("cannot write checkpoint step-000004")

    with pytest.raises(RunDirError), checkpoint.publishing():
        publisher.start(broken, background=True)
    publisher.start(broken, background=True)
    with pytest.raises(KeyError), checkpoint.publishing():  # the run's own failure wins
        raise KeyError("the run failed anyway")
