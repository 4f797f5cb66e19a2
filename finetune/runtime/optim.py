"""Optimizer and learning-rate schedule from the recipe."""

from __future__ import annotations

import math
from typing import Any

import torch

from finetune.backends import full_shape
from finetune.config.schema import OptimConfig, SchedulerConfig
from finetune.errors import ConfigError


def fused_adamw_available(device_type: str) -> bool:
    """Whether this torch has a fused AdamW kernel for ``device_type``, asked through the public API: one fused step
    on a one-element parameter there (torch checks the device at the first step, not at construction)."""
    try:
        param = torch.zeros(1, device=device_type, requires_grad=True)
        param.grad = torch.zeros_like(param)
        torch.optim.AdamW([param], fused=True).step()
    except (RuntimeError, AssertionError):  # no kernel; or no such device in this build ("not compiled with CUDA")
        return False
    return True


def use_fused(choice: bool | None, device_type: str) -> bool:
    """``optim.fused`` on ``device_type``: null means fused wherever this torch has the kernel, true requires it,
    false never uses it.

    Why fused by default on the CPU too: the plain AdamW step is a loop over the parameters; the fused kernel took
    5.7 ms against 23 ms for a 7.4M-parameter model on the project's 2-core CPU, about 6% of that model's packed
    step, and a hand-written loop or the transformers Trainer (whose default is ``adamw_torch_fused``) uses it. Its
    parameters differ from the plain step's by about 1e-10 (another order of the same operations)."""
    if choice is None:
        return fused_adamw_available(device_type)
    if choice and not fused_adamw_available(device_type):
        raise ConfigError(f"optim.fused=true: torch {torch.__version__} has no fused AdamW kernel for device "
                          f"{device_type!r}; set optim.fused to null (fused where available) or false")
    return choice


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module, device_type: str | None = None) -> torch.optim.Optimizer:
    """AdamW or SGD; weight decay applies to matrices only (not biases or norm weights), as is usual.

    A matrix is told by its whole shape (:func:`finetune.backends.full_shape`), not by ``param.ndim``: under
    ZeRO-3 a ``model.path`` model is partitioned at birth, every parameter a 1-D placeholder, and grouping by ``ndim``
    put every matrix in the no-decay group (weight decay silently off). So the groups, and so a checkpoint's param
    groups, are the same under every backend and world size, and a checkpoint resumes on any of them.

    ``device_type`` is where training runs (``accelerator.device.type``): the optimizer is built before
    ``accelerator.prepare`` moves the parameters there, so their current device may not be it. None: the device of
    the parameters now. It decides whether AdamW uses torch's fused kernel (``optim.fused``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(full_shape(p)) >= 2 for p in params]
    groups = [
        {"params": [p for p, m in zip(params, matrix, strict=True) if m], "weight_decay": cfg.weight_decay},
        {"params": [p for p, m in zip(params, matrix, strict=True) if not m], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    device = device_type or (params[0].device.type if params else "cpu")
    if use_fused(cfg.fused, device):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)  # not fused=False: as it always was


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


# A checkpoint's optimizer state holds its param groups' hyperparameters (lr, initial_lr, betas, eps, weight_decay,
# momentum, the kernel flags) and the LambdaLR's state its base_lrs: loading them brings back the values the run had
# when it was saved. A resume with an allowed change of optim.* (`finetune resume RUN optim.lr=1e-4
# --allow-config-change`, the fix a diverged run's message gives) must train with the recipe's values instead; a
# resume without one sets them to what they already are (bit-identical resume is unchanged).


def group_settings(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's hyperparameters as this run's recipe built them: everything but its parameters and the
    current (scheduled) lr. Read before a checkpoint is loaded."""
    return [{key: value for key, value in group.items() if key not in ("params", "lr")}
            for group in optimizer.param_groups]


def keep_recipe_settings(optimizer: Any, scheduler: torch.optim.lr_scheduler.LambdaLR,
                         settings: list[dict[str, Any]]) -> list[str]:
    """After a checkpoint is loaded: the param groups take the recipe's ``settings`` (:func:`group_settings`) again,
    the schedule its base lr (``initial_lr``), and each group's current lr is the schedule's at the restored step.
    Returns one ``name: old -> new`` line per hyperparameter the checkpoint held otherwise. Groups that do not match
    (another grouping) are left as loaded."""
    groups = optimizer.param_groups
    if len(settings) != len(groups):
        return []
    changed = []
    for index, (group, keys) in enumerate(zip(groups, settings, strict=True)):
        changed += [f"optimizer group {index} {key}: {group.get(key)!r} -> {value!r}" for key, value in keys.items()
                    if group.get(key) != value and key in ("initial_lr", "betas", "eps", "weight_decay", "momentum")]
        group.update(keys)
    scheduler.base_lrs = [group["initial_lr"] for group in groups]
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas,
                                                                          strict=True)]
    for group, lr in zip(groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports: the lr of the next step
    return changed
