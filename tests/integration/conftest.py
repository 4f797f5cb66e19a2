"""Helpers for one-process training tests: a tiny-llama recipe on bundled data, run in-process; the shipped recipes
made small."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.recipe_files import write_recipe_file

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
    return with_sections(recipe, **sections)


def with_sections(recipe: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """``recipe`` with each named section updated: a mapping is merged into the section's mapping, anything else
    replaces it. Changes ``recipe`` in place and returns it."""
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    return recipe


@pytest.fixture
def write_run_recipe(tmp_path: Path) -> Callable[..., Path]:
    """Write a recipe dict to tmp_path/<name>.yaml (output_dir tmp_path/runs/<name>) and return its path."""

    def write(recipe: dict[str, Any]) -> Path:
        name = recipe["name"]
        return write_recipe_file(tmp_path / f"{name}.yaml", recipe, output_dir=str(tmp_path / "runs" / name))

    return write


def cli_exit_code(*args: str) -> int:
    """``finetune ARGS`` in this process through the real entry point (:func:`finetune.cli.main`, which turns
    errors and signal stops into exit codes); returns the exit code."""
    from finetune.cli import main

    argv = sys.argv
    sys.argv = ["finetune", *args]
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = argv
    return 0


def write_named(folder: Path, name: str, recipe: dict[str, Any]) -> Path:
    """``recipe`` written to ``folder/<name>.yaml``, named ``name`` and training into ``folder/<name>``."""
    return write_recipe_file(folder / f"{name}.yaml", recipe, name=name, output_dir=str(folder / name))


def recipe_file(folder: Path, name: str, **sections: Any) -> Path:
    """``folder/<name>.yaml``: :func:`tiny_recipe` with ``sections``, training into ``folder/<name>``."""
    return write_named(folder, name, tiny_recipe(**sections))


def trained_run(folder: Path, name: str, **sections: Any) -> Path:
    """A finished run of :func:`recipe_file` (trained in this process through ``finetune run``); its run dir."""
    code = cli_exit_code("run", str(recipe_file(folder, name, **sections)))
    assert code == 0, f"`finetune run` of {name} exited {code}"
    return folder / name


def new_trainer(cfg: Any) -> Any:
    """A built Trainer on a fresh run dir (created as `finetune run` does), for tests that drive the loop."""
    from finetune.runtime.worker import build_trainer
    from finetune.storage import rundir

    run_dir = Path(cfg.output_dir or "")
    rundir.create(run_dir, overwrite=False).release()
    return build_trainer(cfg, run_dir)


def sigterm_after(step: int) -> None:
    """Send SIGTERM to this process right after optimizer step ``step`` of the run it trains (the loop then saves a
    checkpoint at the next step boundary and stops with 143): the one stop that the resume tests resume from."""
    import signal

    from finetune import hooks

    def stop(trainer: Any) -> None:
        if trainer.state.step == step:
            os.kill(os.getpid(), signal.SIGTERM)

    hooks.register("after_step", stop)


def run_stopped_after(recipe: Path, step: int) -> None:
    """``finetune run recipe`` in this process, stopped by :func:`sigterm_after` ``step`` (it exits 143, as this
    asserts); the hooks are cleared before and after."""
    from finetune import hooks

    hooks.clear()
    sigterm_after(step)
    try:
        assert cli_exit_code("run", str(recipe)) == 143
    finally:
        hooks.clear()


def run_in_process(cfg: Any) -> Path:
    """Train a validated recipe in this process as `finetune run` does: create and lock the run dir (marker, run
    id), write the resolved recipe, train; returns the run dir."""
    from finetune.runtime.worker import run_worker
    from finetune.storage import rundir

    run_dir = Path(cfg.output_dir or "")
    with rundir.create(run_dir, overwrite=False):
        run_worker(rundir.write_resolved(cfg, run_dir))
    return run_dir


@pytest.fixture
def train_recipe(write_run_recipe: Callable[..., Path]) -> Callable[..., Path]:
    """Compose, write the resolved recipe and train in this process, as `finetune run` does; returns the run dir."""
    from finetune.config import load_recipe

    def train(recipe: dict[str, Any], overrides: list[str] | None = None) -> Path:
        cfg, _ = load_recipe(write_run_recipe(recipe), overrides)
        return run_in_process(cfg)

    return train


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The exported model's tensors."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def max_rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest per-tensor max|a-b| / max|a| over two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


def shrink_data(source: Path, target: Path, rows: int) -> None:
    """The first ``rows`` lines of a data file; for vision rows, the images they name beside them."""
    lines = source.read_text(encoding="utf-8").splitlines()[:rows]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for image in re.findall(r'"image": "([^"]+)"', "\n".join(lines)):
        (target.parent / image).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source.parent / image, target.parent / image)


def small_recipes(folder: Path, steps: dict[str, int]) -> Path:
    """``folder/recipes``: every shipped recipe made small (same keys; 2-row steps, ``steps[name]`` of them or 2, a
    checkpoint at the last, evaluation only at the end, the architecture's tiny default size), its data cut to a
    few rows."""
    recipes = folder / "recipes"
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        recipe = yaml.safe_load(path.read_text())
        for split, rows in (("train", 64), ("eval", 8)):
            name = recipe["data"][split]
            shrink_data(path.parent / name, recipes / name, rows)
        if "config_overrides" in recipe["model"]:
            recipe["model"]["config_overrides"] = {}
        count = steps.get(path.stem, 2)
        recipe["train"].update(micro_batch_size=2, global_batch_size=2, max_steps=count, epochs=None)
        recipe["eval"].update(every_steps=None, at_start=False, max_new_tokens=4, batch_size=8)
        recipe["checkpoint"].update(every_steps=count, keep_last=5)
        recipe["logging"]["every_steps"] = 50
        write_recipe_file(recipes / path.name, recipe)
    return recipes
