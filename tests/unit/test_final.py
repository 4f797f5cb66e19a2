"""finetune.artifacts.final on one CPU process: a run's ``final/`` holds the live model's weights, the tokenizer,
the resolved recipe and a manifest naming the run, the step and the layout; weights that are not all finite are
never exported, and a previous ``final/`` stays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from finetune.artifacts.final import export_final
from finetune.backends import backend_named
from finetune.config import RecipeConfig
from finetune.errors import NonFiniteError
from finetune.registry import SUPPORTED_MODELS
from finetune.runtime.context import RunContext
from finetune.storage import rundir


def _context(tmp_path: Path, tok: Any) -> RunContext:
    """One CPU process of a tiny-llama run in ``tmp_path/run``."""
    from accelerate import Accelerator

    (tmp_path / "t.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    cfg = RecipeConfig.model_validate({"name": "r", "model": {"type": "tiny-llama"},
                                       "data": {"format": "alpaca", "train": str(tmp_path / "t.jsonl")},
                                       "train": {"max_steps": 4, "micro_batch_size": 1, "global_batch_size": 1}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return RunContext(cfg=cfg, run_dir=run_dir, run_id="run-7", row=SUPPORTED_MODELS["tiny-llama"], labels=None,
                      backend=backend_named("single"), accelerator=Accelerator(cpu=True), tokenizer=tok, max_steps=4)


def test_final_holds_the_live_weights_the_tokenizer_the_recipe_and_a_manifest(tmp_path: Path, llama: Any,
                                                                             tok: Any) -> None:
    ctx = _context(tmp_path, tok)
    out = export_final(ctx, llama, step=4)
    assert out == tmp_path / "run" / "final"
    weights = load_file(str(out / "model.safetensors"))
    live = llama.state_dict()
    assert set(weights) <= set(live) and "model.embed_tokens.weight" in weights
    assert all(torch.equal(weights[name], live[name]) for name in weights)
    manifest = json.loads((out / rundir.MANIFEST).read_text())
    assert (manifest["kind"], manifest["run_id"], manifest["step"]) == ("export", "run-7", 4)
    assert manifest["layout"]["backend"] == "single" and manifest["layout"]["world_size"] == 1
    assert (out / rundir.RESOLVED).read_text().startswith("name: r")
    assert (out / "tokenizer_config.json").is_file()
    assert not (tmp_path / "run" / rundir.FINAL_TMP).exists()


def test_weights_that_are_not_finite_are_never_exported(tmp_path: Path, llama: Any, tok: Any) -> None:
    ctx = _context(tmp_path, tok)
    previous = ctx.run_dir / rundir.FINAL
    previous.mkdir()
    (previous / "kept").write_text("the export before")
    broken = type(llama)(llama.config)
    broken.load_state_dict(llama.state_dict())
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="inf or nan"):
        export_final(ctx, broken, step=4)
    assert sorted(p.name for p in previous.iterdir()) == ["kept"]
