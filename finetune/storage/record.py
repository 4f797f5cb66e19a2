"""What a checkpoint's or an export's manifest records for the commands that open it later: the model row (model type
and task) and the classification label names (the layout is :func:`finetune.backends.layout`'s record).

Recorded when the folder is written (:func:`record`) and read back when it is opened (:func:`row_of`,
:func:`labels_of`), so that no command re-resolves the row from a recipe or re-reads the training data to learn the
labels. """

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune import registry
from finetune.config import RecipeConfig
from finetune.errors import RunDirError
from finetune.registry import SupportedModel


def record(cfg: RecipeConfig, row: SupportedModel, labels: list[str] | None) -> dict[str, Any]:
    """The part of a checkpoint's or export's manifest that a later command opens it with: the row (model type and
    task, as :func:`finetune.registry.recipe_row` resolved them) and the classification label names."""
    return {"row": {"model_type": cfg.model.type, "task": row.task, "name": row.name},
            "labels": list(labels) if labels is not None else None}


def row_of(manifest: dict[str, Any], cfg: RecipeConfig) -> SupportedModel:
    """The row a manifest recorded (:func:`record`); the recipe's row for a folder written before rows were."""
    stored = manifest.get("row")
    if isinstance(stored, dict) and isinstance(stored.get("model_type"), str):
        return registry.get_model(stored["model_type"], stored.get("task"))
    return registry.recipe_row(cfg)


def labels_of(manifest: dict[str, Any], cfg: RecipeConfig, row: SupportedModel, where: Path) -> list[str] | None:
    """The classification label names a manifest recorded (:func:`record`); for a folder written before they were
    recorded, the recipe's ``data.labels``, else a full model's own ``config.json`` mapping, else one line that says
    how to give them (the training data is never read to learn them)."""
    if not registry.row_task(row).labels:
        return None
    if isinstance(manifest.get("labels"), list):
        return [str(name) for name in manifest["labels"]]
    if cfg.data.labels:
        return list(cfg.data.labels)
    config = where / "config.json"  # a full model written before: its own label mapping
    try:
        mapping = json.loads(config.read_text(encoding="utf-8")).get("id2label") if config.is_file() else None
        if isinstance(mapping, dict) and mapping:
            return [str(mapping[key]) for key in sorted(mapping, key=int)]
    except (OSError, ValueError, AttributeError):  # a damaged config.json: the line below says what to do
        pass
    raise RunDirError(f"{where}: its manifest records no classification labels (written by an older finetune); "
                      "give them in training order, e.g. data.labels='[neg, pos]', or use a newer checkpoint")
