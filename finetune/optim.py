"""Optimizer and learning-rate schedule from the recipe."""

from __future__ import annotations

import math
from typing import Any

import torch

from finetune.config.schema import OptimConfig, SchedulerConfig


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW or SGD; weight decay applies to matrices only (not biases or norm weights), as is usual."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def lr_factor(step: int, cfg: SchedulerConfig, total_steps: int) -> float:
    """Multiplier of the base lr for optimizer step ``step`` (0-based).

    Warmup is linear and never uses lr 0 (step 0 gets lr/warmup); after warmup the lr stays constant or decays
    linearly / by a cosine to ``min_lr_ratio`` at the last step.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    decay = 1.0 - progress if cfg.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(cfg: SchedulerConfig, optimizer: Any, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_factor`; stepped once per optimizer step by the loop (never per rank)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
