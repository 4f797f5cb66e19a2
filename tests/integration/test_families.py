"""A model family without a row, end to end: ``finetune run`` on a tiny random GPT-NeoX folder whose recipe names no
``model.type`` trains with the row derived from transformers (said once on stderr), records the type in the resolved
recipe and the row in the export's manifest, exports a model transformers loads as its own class, and ``finetune
eval`` of the run, in a process state that holds no derived row, derives it again and reproduces the run's eval.

One run of 2 steps: the rules of the derivation are unit tests (tests/unit/test_families.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from finetune import registry
from finetune.config import families
from finetune.storage import rundir
from finetune.storage.metrics import read_metrics
from tests.cli_helpers import main_exit
from tests.integration.conftest import tiny_recipe, write_named

pytestmark = pytest.mark.integration

ASSETS = Path(__file__).resolve().parents[2] / "finetune" / "assets"
NEOX = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 512, "max_position_embeddings": 512}


def test_a_family_without_a_row_trains_exports_and_evaluates_without_model_type(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert "gpt_neox" not in {t for row in registry.SUPPORTED_MODELS.values() for t in row.model_types}
    monkeypatch.setattr(registry, "DERIVED", {})
    folder = tmp_path / "neox-model"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.GPTNeoXConfig(**NEOX)).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(folder)
    recipe = tiny_recipe(name="neox", train={"max_steps": 2}, eval={"metrics": ["token_accuracy"], "batch_size": 64},
                         scheduler={"warmup_steps": 0})
    recipe["model"] = {"path": str(folder)}  # no type: read from the folder's config.json
    code, out, err = main_exit(monkeypatch, capsys, "run", str(write_named(tmp_path, "neox", recipe)))
    assert code == 0, err
    assert err.count("warning: model.type: gpt_neox has no row") == 1, err  # the export's fresh process says nothing
    run = tmp_path / "neox"
    assert yaml.safe_load((run / rundir.RESOLVED).read_text())["model"]["type"] == "gpt_neox"
    assert rundir.read_manifest(run / rundir.FINAL)["row"] == {"model_type": "gpt_neox", "task": "causal_lm",
                                                               "name": "gpt_neox"}
    exported = transformers.AutoModelForCausalLM.from_pretrained(run / rundir.FINAL)
    assert type(exported).__name__ == "GPTNeoXForCausalLM"
    trained = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]

    monkeypatch.setattr(registry, "DERIVED", {})  # as a new command: the row is derived again from the recipe
    monkeypatch.delenv(families.SAID_ENV)  # and said again
    code, out, err = main_exit(monkeypatch, capsys, "eval", str(run), "--json")
    assert code == 0, err
    again = json.loads(out)
    assert again["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-5)
    assert again["eval_token_accuracy"] == pytest.approx(trained["eval_token_accuracy"])
    assert err.count("warning: model.type: gpt_neox has no row") == 1 and "gpt_neox" in registry.DERIVED
