"""Helpers for one-process training tests: a tiny-llama recipe on bundled data, run in-process."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "recipes" / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def tiny_recipe(**sections: Any) -> dict[str, Any]:
    """A small tiny-llama recipe on the bundled reverse data; ``sections`` update the named sections."""
    recipe: dict[str, Any] = {
        "name": "tiny",
        "model": {"type": "tiny-llama"},
        "data": {"format": "alpaca", "train": str(DATA / "reverse_train.jsonl"),
                 "eval": str(DATA / "reverse_eval.jsonl"), "max_seq_len": 64},
        "train": {"seed": 7, "micro_batch_size": 4, "global_batch_size": 8, "max_steps": 8},
        "optim": {"lr": 1.0e-3},
        "scheduler": {"name": "cosine", "warmup_steps": 2},
        "logging": {"every_steps": 1, "progress": False},
        "checkpoint": {"every_steps": None},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    return recipe


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """Write a recipe dict to tmp_path/<name>.yaml (output_dir inside tmp_path) and return its path."""

    def write(recipe: dict[str, Any]) -> Path:
        recipe = {**recipe, "output_dir": str(tmp_path / "runs" / recipe["name"])}
        path = tmp_path / f"{recipe['name']}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    return write


@pytest.fixture
def train_recipe(write_recipe: Callable[..., Path]) -> Callable[..., Path]:
    """Compose, write the resolved recipe and train in this process, as `finetune run` does; returns the run dir."""
    from finetune.config import load_recipe, write_resolved
    from finetune.worker import run_worker

    def train(recipe: dict[str, Any], overrides: list[str] | None = None) -> Path:
        cfg, _ = load_recipe(write_recipe(recipe), overrides)
        run_worker(write_resolved(cfg, cfg.output_dir or ""))
        return Path(cfg.output_dir or "")

    return train


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The exported model's tensors."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def max_rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest per-tensor max|a-b| / max|a| over two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)
