"""Task adapters: one per SupportedModel task, or per objective (the recipe's ``task``: dpo, reward)."""

from __future__ import annotations

from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.data import DataBundle
from finetune.registry import GENERATING_METRICS, SupportedModel
from finetune.tasks.base import EvalCounts, Task
from finetune.tasks.causal_lm import CausalLMTask
from finetune.tasks.classification import ClassificationTask
from finetune.tasks.distill import DistillTask
from finetune.tasks.dpo import DPOTask
from finetune.tasks.grpo import GRPOTask
from finetune.tasks.reward import RewardTask
from finetune.tasks.vision_lm import VisionCausalLMTask

# The adapter of a recipe's ``task`` (dpo, reward, grpo), else of the model row's own task (``task: null`` or sft),
# with the build inputs it takes besides the ones every adapter takes (config, data, pad id, rank, world, lockstep,
# row). A new task adds its row here and its record in finetune.objectives.
ADAPTERS: dict[str, tuple[type[Task], tuple[str, ...]]] = {
    "dpo": (DPOTask, ()),
    "reward": (RewardTask, ()),
    "grpo": (GRPOTask, ("tokenizer", "allow_plugin", "frozen_copy")),
    "distill": (DistillTask, ("with_prompts", "tokenizer", "teacher")),
    "classification": (ClassificationTask, ()),
    "vision_causal_lm": (VisionCausalLMTask, ("with_prompts", "tokenizer", "images")),
    "causal_lm": (CausalLMTask, ("with_prompts", "tokenizer")),
}


def build_task(cfg: RecipeConfig, row: SupportedModel, tokenizer: Any, data: DataBundle, rank: int,
               world: int, lockstep: bool = False, images: Any = None, allow_plugin: bool = False,
               frozen_copy: Any = None, teacher: Any = None) -> Task:
    """The adapter for the recipe's ``task`` (null / sft: the row's own task), over this rank's data (``lockstep``:
    see TaskData; ``images``: a vision-language row's image processor; ``allow_plugin``: the recipe's code may be
    imported, e.g. a GRPO reward function; ``frozen_copy``: the backend's frozen copy of the prepared model, for a
    reference that runs only forward passes: see GRPOTask; ``teacher``: the factory of a distillation's placed
    teacher, see DistillTask)."""
    adapter, takes = ADAPTERS.get(cfg.task or "") or ADAPTERS[row.task]
    inputs = {"tokenizer": tokenizer, "allow_plugin": allow_plugin, "frozen_copy": frozen_copy, "images": images,
              "teacher": teacher,
              "with_prompts": bool(GENERATING_METRICS.intersection(cfg.eval.metrics))}
    return adapter(cfg, data, tokenizer.pad_token_id, rank, world, lockstep=lockstep, row=row,  # type: ignore[call-arg]
                   **{name: inputs[name] for name in takes})


__all__ = ["ADAPTERS", "EvalCounts", "Task", "build_task"]
