"""``finetune plan`` needs only a model's config.json: a Llama-2-7B-shaped folder with no weights and no tokenizer
is planned (the numbers docs/memory-plan.md shows), while ``finetune run`` on it is still refused before anything
starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_helpers import assert_user_error, main_exit
from tests.recipe_files import write_recipe_file

REPO = Path(__file__).resolve().parents[2]
LLAMA_2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "hidden_act": "silu", "torch_dtype": "float16", "tie_word_embeddings": False}


@pytest.fixture
def recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A recipe whose model.path is a folder holding only Llama-2-7B's config.json."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FINETUNE_DEBUG", raising=False)
    (tmp_path / "llama-2-7b").mkdir()
    (tmp_path / "llama-2-7b" / "config.json").write_text(json.dumps(LLAMA_2_7B))
    path = tmp_path / "llama7b.yaml"
    write_recipe_file(path, {
        "name": "llama7b", "model": {"type": "llama", "path": "llama-2-7b", "dtype": "bfloat16"},
        "data": {"format": "alpaca", "train": str(REPO / "recipes" / "data" / "reverse_train.jsonl"),
                 "max_seq_len": 2048},
        "train": {"micro_batch_size": 1, "global_batch_size": 8, "max_steps": 100, "mixed_precision": "bf16",
                  "gradient_checkpointing": True}})
    return path


def test_plan_of_a_config_only_7b_folder(recipe: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = main_exit(monkeypatch, capsys, "plan", str(recipe), "--accelerate-config", "zero3",
                               "--num-processes", "8")
    assert code == 0, err
    print(out)  # docs/memory-plan.md's 7B example is this output (pytest -s shows it)
    assert "parameters: 6,738,415,616 total, 6,738,415,616 trainable" in out, out
    assert "sharding: DeepSpeed ZeRO-3: parameters, gradients and optimizer states / 8" in out
    # training needs the weights: still one line before anything is created
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe))
    assert_user_error(code, out, err, "holds no weights")
    assert not (recipe.parent / "runs").exists()
    # any other problem is still reported
    code, out, err = main_exit(monkeypatch, capsys, "plan", str(recipe), "train.max_stepz=3")
    assert_user_error(code, out, err, "train.max_stepz: unknown key")


def test_plan_of_a_hub_name_whose_cache_holds_only_config_json(recipe: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """model.path: org/name, offline, with only that repository's config.json in the hub cache (what a plan
    downloads online): planned, no weights or tokenizer needed."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--acme--small-llama"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    small = {**LLAMA_2_7B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 512}
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(small))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, out, err = main_exit(monkeypatch, capsys, "plan", str(recipe), "model.path=acme/small-llama", "--json")
    assert code == 0, err
    assert json.loads(out)["total_params"] == 2 * 512 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64

