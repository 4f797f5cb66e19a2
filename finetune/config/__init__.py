"""Recipes: compose (YAML + extends + overrides), validate (pydantic), and the resolved recipe file."""

from __future__ import annotations

from pathlib import Path

import yaml

from finetune.config.compose import Composed, compose
from finetune.config.schema import RecipeConfig
from finetune.config.validate import load_resolved, validate


def load_recipe(recipe: str | Path, overrides: list[str] | None = None) -> tuple[RecipeConfig, Composed]:
    """Compose and validate a recipe file with overrides."""
    composed = compose(recipe, overrides)
    return validate(composed), composed


def to_yaml(cfg: RecipeConfig) -> str:
    """The full recipe, defaults included, as YAML (the resolved recipe's text)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


__all__ = ["Composed", "RecipeConfig", "compose", "load_recipe", "load_resolved", "to_yaml", "validate"]
