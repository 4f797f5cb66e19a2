"""The run's context is fixed: built once, it cannot be changed by the loop, a hook or the export."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.config import RecipeConfig
from finetune.registry import SUPPORTED_MODELS
from finetune.runtime.context import RunContext


def _context() -> RunContext:
    cfg = RecipeConfig.model_validate({"name": "r", "model": {"type": "tiny-llama"},
                                       "data": {"format": "alpaca", "train": "t.jsonl"}, "train": {"max_steps": 3}})
    return RunContext(cfg=cfg, run_dir=Path("runs/r"), run_id="id-1", row=SUPPORTED_MODELS["tiny-llama"],
                      labels=None, backend=SimpleNamespace(name="single"), accelerator=None, tokenizer=None,
                      max_steps=3)


@pytest.mark.parametrize(("field", "value"), [("max_steps", 4), ("run_dir", Path("elsewhere")), ("run_id", "id-2"),
                                              ("labels", ["a", "b"])])
def test_no_field_can_be_assigned(field: str, value: object) -> None:
    ctx = _context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(ctx, field, value)
    assert (ctx.max_steps, ctx.run_dir, ctx.run_id, ctx.labels) == (3, Path("runs/r"), "id-1", None)


def test_it_holds_exactly_the_facts_that_never_change_during_a_run() -> None:
    assert [f.name for f in dataclasses.fields(RunContext)] == [
        "cfg", "run_dir", "run_id", "row", "labels", "backend", "accelerator", "tokenizer", "max_steps"]
