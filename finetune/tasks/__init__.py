"""Task adapters: one per SupportedModel task."""

from __future__ import annotations

from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.data import DataBundle
from finetune.registry import SupportedModel
from finetune.tasks.base import EvalCounts, Task
from finetune.tasks.causal_lm import CausalLMTask
from finetune.tasks.classification import ClassificationTask


def build_task(cfg: RecipeConfig, row: SupportedModel, tokenizer: Any, data: DataBundle, rank: int,
               world: int, lockstep: bool = False) -> Task:
    """The adapter for the row's task, over this rank's data (``lockstep``: see TaskData)."""
    if row.task == "classification":
        return ClassificationTask(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep)
    return CausalLMTask(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep,
                        with_prompts="exact_match" in cfg.eval.metrics, tokenizer=tokenizer)


__all__ = ["EvalCounts", "Task", "build_task"]
