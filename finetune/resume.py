"""Planning a resume in the front process (no torch): which checkpoint, and what changed since it was written.

A resume continues the same run, so any difference between the checkpoint's recipe and the present one, or
between the data files then and now, is refused (listing every difference) unless the user passes
``--allow-config-change``; then the differences are written to train.log. Keys that change how the work is laid
out but not the math (process count, accelerate config, micro-batch size, progress bar) are always allowed: the
data cursor and the token-weighted loss do not depend on them. The tokenizer is compared in the worker, which
loads it anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from finetune import checkpoint
from finetune.config import RESOLVED_NAME, RecipeConfig, compose, validate
from finetune.config.compose import flatten
from finetune.errors import FinetuneError, RunDirError

LAYOUT_KEYS = ("launch.num_processes", "launch.accelerate_config", "train.micro_batch_size", "logging.progress",
               "output_dir")


@dataclass
class ResumePlan:
    """The recipe to continue with, the checkpoint to continue from, and what differs from it."""

    cfg: RecipeConfig
    checkpoint: checkpoint.CheckpointInfo
    changes: list[str] = field(default_factory=list)
    layout_changes: list[str] = field(default_factory=list)


def recipe_changes(before: dict[str, Any], after: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(changes that alter the run, layout-only changes), one ``key: old -> new`` line each."""
    old, new = flatten(before), flatten(after)
    changes, layout = [], []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) != new.get(key):
            line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
            (layout if key in LAYOUT_KEYS else changes).append(line)
    return changes, layout


def data_changes(cfg: RecipeConfig, manifest: dict[str, Any]) -> list[str]:
    """Data files whose content differs from the fingerprints in the manifest."""
    stored = manifest.get("data", {})
    lines = []
    for split, path in (("train", cfg.data.train), ("eval", cfg.data.eval)):
        now = checkpoint.file_fingerprint(path)
        if now != stored.get(split):
            lines.append(f"data.{split}: {path} changed since the checkpoint (sha256 {str(stored.get(split))[:12]} "
                         f"-> {str(now)[:12]})")
    return lines


def plan(run_dir: Path, overrides: list[str], from_name: str | None, allow_change: bool) -> ResumePlan:
    """Pick the checkpoint and compose the recipe to continue with; refuse changes unless allowed."""
    if not (run_dir / RESOLVED_NAME).is_file():
        raise RunDirError(f"{run_dir}: not a run directory (no {RESOLVED_NAME}); start one with `finetune run`")
    info = checkpoint.find(run_dir, from_name)
    stored = info.path / RESOLVED_NAME
    cfg = validate(compose(stored, [*overrides, f"output_dir={run_dir.resolve()}"]))
    try:  # the stored recipe under today's schema: keys added since then hold their defaults, not "changes"
        before = validate(compose(stored, [f"output_dir={run_dir.resolve()}"])).model_dump(mode="json")
    except FinetuneError:
        before = yaml.safe_load(stored.read_text())
    changes, layout = recipe_changes(before, cfg.model_dump(mode="json"))
    changes += data_changes(cfg, info.manifest or {})
    if changes and not allow_change:
        raise RunDirError("\n".join([f"resume refused: the run changed since {info.path.name}:", *changes,
                                     "pass --allow-config-change to continue anyway (the changes are logged)"]))
    return ResumePlan(cfg, info, changes, layout)
