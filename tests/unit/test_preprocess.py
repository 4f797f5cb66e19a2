"""``finetune preprocess RECIPE`` tokenizes every split into the cache that ``finetune run`` then reads.

The first call says each source was tokenized now, the second that it was read from the cache; after it, the
inputs a run reads (``prepare.inputs``) tokenize nothing. A data file rewritten in between is tokenized again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from typer.testing import CliRunner

from finetune import hooks
from finetune.cli import app
from finetune.config import load_recipe
from finetune.registry import recipe_row
from finetune.runtime import prepare


def preprocess(recipe: Path) -> list[str]:
    result = CliRunner().invoke(app, ["preprocess", str(recipe)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [line for line in result.stdout.splitlines() if line.startswith("data.")]


def test_preprocess_fills_the_cache_that_a_run_reads(write_recipe: Callable[..., Path], minimal_recipe: dict,
                                                     tmp_path: Path) -> None:
    minimal_recipe["data"]["eval"] = "eval.jsonl"
    recipe = write_recipe(minimal_recipe)
    assert preprocess(recipe) == [f"data.train {tmp_path}/train.jsonl: 4 samples, tokenized now (cached)",
                                  f"data.eval {tmp_path}/eval.jsonl: 4 samples, tokenized now (cached)"]
    assert preprocess(recipe) == [f"data.train {tmp_path}/train.jsonl: 4 samples, read from the cache",
                                  f"data.eval {tmp_path}/eval.jsonl: 4 samples, read from the cache"]
    tokenized: list[str] = []
    hooks.register("tokenizing", lambda source: tokenized.append(source))
    cfg, _ = load_recipe(str(recipe))
    inputs = prepare.inputs(cfg, recipe_row(cfg))
    assert tokenized == [] and inputs.data.train is not None and inputs.data.train.cached
    # finetune run says so too: one line per source read from the cache (one tokenized now says so as it goes)
    assert prepare.report(cfg, inputs.data, hits_only=True) == preprocess(recipe)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"instruction": "Other.", "output": "x"}) + "\n")
    again = prepare.inputs(cfg, recipe_row(cfg))
    assert prepare.report(cfg, again.data, hits_only=True) == [
        f"data.train {tmp_path}/train.jsonl: 4 samples, read from the cache"]


def test_a_changed_data_file_is_tokenized_again(write_recipe: Callable[..., Path], tmp_path: Path) -> None:
    recipe = write_recipe()
    preprocess(recipe)
    (tmp_path / "train.jsonl").write_text(json.dumps({"instruction": "Other.", "output": "x"}) + "\n")
    assert preprocess(recipe) == [f"data.train {tmp_path}/train.jsonl: 1 sample, tokenized now (cached)"]


def test_run_says_which_sources_it_read_from_the_cache(write_recipe: Callable[..., Path], tmp_path: Path) -> None:
    recipe = write_recipe()
    preprocess(recipe)
    result = CliRunner().invoke(app, ["run", str(recipe), "-o", str(tmp_path / "run")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"data.train {tmp_path}/train.jsonl: 4 samples, read from the cache"


def test_preprocess_is_listed_in_the_help() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert "preprocess" in result.stdout
