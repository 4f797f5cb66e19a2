"""Shared fixtures: small, valid recipes (with their data files) in a temporary folder."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ALPACA_ROWS = [{"instruction": "Reverse the letters.", "input": "a b c", "output": "c b a"}] * 4

# The smallest recipe that validates: tiny-llama (no download), one alpaca file next to the recipe.
MINIMAL_RECIPE = {
    "name": "tiny",
    "model": {"type": "tiny-llama"},
    "data": {"format": "alpaca", "train": "train.jsonl"},
    "train": {"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 4},
}


@pytest.fixture
def minimal_recipe() -> dict:
    """A fresh copy of the smallest valid recipe (as a dict) that ``write_recipe`` writes by default."""
    return copy.deepcopy(MINIMAL_RECIPE)


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """``write_recipe(text_or_dict=MINIMAL_RECIPE, name="recipe.yaml", folder=tmp_path)`` -> the recipe's path.

    A dict is dumped as block YAML (one key per line); a string is written verbatim. ``train.jsonl`` and
    ``eval.jsonl`` (alpaca rows) are created in the folder so relative data paths resolve.
    """

    def write(content: str | dict | None = None, name: str = "recipe.yaml", folder: Path | None = None) -> Path:
        folder = folder or tmp_path
        folder.mkdir(parents=True, exist_ok=True)
        for split in ("train", "eval"):
            data = folder / f"{split}.jsonl"
            if not data.exists():
                data.write_text("".join(json.dumps(row) + "\n" for row in ALPACA_ROWS))
        content = MINIMAL_RECIPE if content is None else content
        text = content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)
        path = folder / name
        path.write_text(text)
        return path

    return write
