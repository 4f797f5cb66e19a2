"""Recipes: compose (YAML + extends + overrides), validate (pydantic), and the resolved recipe file."""

from __future__ import annotations

from pathlib import Path

import yaml

from finetune.config.compose import Composed, compose
from finetune.config.schema import RecipeConfig
from finetune.config.validate import load_resolved, validate
from finetune.errors import ConfigError


def load_recipe(recipe: str | Path, overrides: list[str] | None = None, *,
                weights: bool = True) -> tuple[RecipeConfig, Composed]:
    """Compose and validate a recipe file with overrides (``weights``: see :func:`validate`)."""
    composed = compose(recipe, overrides)
    return validate(composed, weights=weights), composed


REMOTE_CODE_KEY = "model.trust_remote_code"


def remote_code_from_flag(overrides: list[str], trust_remote_code: bool) -> list[str]:
    """``overrides`` plus the one that sets ``model.trust_remote_code`` from ``--trust-remote-code``: commands that
    load what a run wrote (eval, merge, resume) never take it from the run's recipe, nor from a dotted override."""
    if any(item.split("=", 1)[0].strip() == REMOTE_CODE_KEY for item in overrides):
        raise ConfigError(f"{REMOTE_CODE_KEY} cannot be overridden here; pass --trust-remote-code")
    return [*overrides, f"{REMOTE_CODE_KEY}={str(trust_remote_code).lower()}"]


def to_yaml(cfg: RecipeConfig) -> str:
    """The full recipe, defaults included, as YAML (the resolved recipe's text)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


__all__ = ["REMOTE_CODE_KEY", "Composed", "RecipeConfig", "compose", "load_recipe", "load_resolved",
           "remote_code_from_flag", "to_yaml", "validate"]
