"""What the unit tests of recipe composition and validation (tests/unit/test_compose.py, test_validate.py) share: a
recipe text whose lines they name, and the ConfigError a recipe raises, as its lines (both check every message line
by line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.config import load_recipe
from finetune.errors import ConfigError


def errors_of(recipe: Path, overrides: list[str] | None = None) -> list[str]:
    """The lines of the ConfigError that composing + validating ``recipe`` raises."""
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, overrides)
    return str(info.value).splitlines()


def one_error(recipe: Path, overrides: list[str] | None = None) -> str:
    lines = errors_of(recipe, overrides)
    assert len(lines) == 1, lines
    return lines[0]


RECIPE_TEXT = """\
# a comment line
name: prov
model:
  type: tiny-llama
data: {format: alpaca, train: train.jsonl}
train:
  max_steps: 4
  micro_batch_size: 2
  global_batch_size: 4
"""
