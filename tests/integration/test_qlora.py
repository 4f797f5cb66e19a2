"""QLoRA on this CPU machine: bitsandbytes' CPU backend quantizes the base to 4-bit NF4, LoRA trains on top, and
`finetune merge` merges into the full-precision base and says so (the 4-bit gap is reported, not gated on)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.storage.metrics import read_metrics
from tests.integration.conftest import tiny_recipe

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory) -> Path:
    """A tiny llama saved like a hub checkpoint (QLoRA quantizes pretrained weights at load time)."""
    import torch
    import transformers

    from finetune.registry import SUPPORTED_MODELS
    from finetune.runtime.modeling import ASSETS

    out = tmp_path_factory.mktemp("tiny-llama-pretrained")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SUPPORTED_MODELS["llama"].tiny_config)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(out)
    return out


def test_qlora_trains_on_a_4bit_base_and_merges(tmp_path: Path, pretrained_dir: Path, write_run_recipe) -> None:
    pytest.importorskip("bitsandbytes")
    recipe = tiny_recipe(name="qlora", model={"type": "llama", "path": str(pretrained_dir)},
                         peft={"method": "qlora", "preset": "attn"}, train={"max_steps": 2},
                         eval={"metrics": ["token_accuracy"], "batch_size": 100})
    runner = CliRunner()
    done = runner.invoke(app, ["run", str(write_run_recipe(recipe))])
    assert done.exit_code == 0, done.output
    run = tmp_path / "runs" / "qlora"
    log = (run / "train.log").read_text()
    assert "qlora:" in log and "trainable" in log
    assert (run / "final" / "adapter_model.safetensors").is_file()
    merged = runner.invoke(app, ["merge", str(run), "-o", str(tmp_path / "merged")])
    assert merged.exit_code == 0, merged.output
    assert "QLoRA: merged into the full-precision base" in merged.output and "merge check passed" in merged.output
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    from finetune.commands.evaluate import evaluate_target

    live = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]
    assert evaluate_target(run, [])["eval_loss"] == pytest.approx(live["eval_loss"], rel=1e-3)
