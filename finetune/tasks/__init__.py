"""Task adapters: one per SupportedModel task, or per objective (the recipe's ``task``: dpo, reward)."""

from __future__ import annotations

from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.data import DataBundle
from finetune.registry import SupportedModel
from finetune.tasks.base import EvalCounts, Task
from finetune.tasks.causal_lm import CausalLMTask
from finetune.tasks.classification import ClassificationTask
from finetune.tasks.dpo import DPOTask
from finetune.tasks.grpo import GRPOTask
from finetune.tasks.reward import RewardTask
from finetune.tasks.vision_lm import VisionCausalLMTask


def build_task(cfg: RecipeConfig, row: SupportedModel, tokenizer: Any, data: DataBundle, rank: int,
               world: int, lockstep: bool = False, images: Any = None, allow_plugin: bool = False,
               frozen_copy: Any = None) -> Task:
    """The adapter for the recipe's ``task`` (null / sft: the row's own task), over this rank's data (``lockstep``:
    see TaskData; ``images``: a vision-language row's image processor; ``allow_plugin``: the recipe's code may be
    imported, e.g. a GRPO reward function; ``frozen_copy``: the backend's frozen copy of the prepared model, for a
    reference that runs only forward passes: see GRPOTask)."""
    if cfg.task == "dpo":
        return DPOTask(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep, row=row)
    if cfg.task == "grpo":
        return GRPOTask(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep, tokenizer=tokenizer,
                        allow_plugin=allow_plugin, frozen_copy=frozen_copy, row=row)
    if cfg.task == "reward":
        return RewardTask(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep, row=row)
    if row.task == "classification":
        return ClassificationTask(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep, row=row)
    with_prompts = "exact_match" in cfg.eval.metrics
    if row.task == "vision_causal_lm":
        return VisionCausalLMTask(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep,
                                  with_prompts=with_prompts, tokenizer=tokenizer, images=images, row=row)
    return CausalLMTask(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep,
                        with_prompts=with_prompts, tokenizer=tokenizer, row=row)


__all__ = ["EvalCounts", "Task", "build_task"]
