"""Recipes: compose (YAML + extends + overrides), validate (pydantic), and the resolved recipe file."""

from __future__ import annotations

from pathlib import Path

import yaml

from finetune.config.compose import Composed, compose
from finetune.config.schema import RecipeConfig
from finetune.config.validate import load_resolved, validate

RESOLVED_NAME = "recipe.resolved.yaml"


def load_recipe(recipe: str | Path, overrides: list[str] | None = None) -> tuple[RecipeConfig, Composed]:
    """Compose and validate a recipe file with overrides."""
    composed = compose(recipe, overrides)
    return validate(composed), composed


def to_yaml(cfg: RecipeConfig) -> str:
    """The full recipe, defaults included, as YAML (the resolved recipe's text)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def write_resolved(cfg: RecipeConfig, run_dir: str | Path) -> Path:
    """Write <run_dir>/recipe.resolved.yaml atomically; from here on it is the single source of truth."""
    path = Path(run_dir) / RESOLVED_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg))
    tmp.replace(path)
    return path


__all__ = ["RESOLVED_NAME", "Composed", "RecipeConfig", "compose", "load_recipe", "load_resolved", "to_yaml",
           "validate", "write_resolved"]
