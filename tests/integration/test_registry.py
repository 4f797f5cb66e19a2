"""Every text decoder family of the SupportedModel table trains from its own checkpoint folder, with nothing but
``model.type`` and ``model.path``: a folder as the hub ships it (the row's tiny config with seeded random weights,
saved by transformers, and the bundled tiny tokenizer), two steps of SFT, full and LoRA.

Per row: the full run's losses are the row's golden losses (produced by this code at the commit that added them:
the folder's weights from seed 0, recipe seed 7, 2 steps of micro 2 x accumulation 2 on the bundled chat data,
lr 1e-3); its final/ loads with transformers and gives the logits the training process
recorded at the last step; the LoRA run's adapter loads with PEFT on the folder's model and gives the logits the
live model had at export, and for Gemma 2 (tied embeddings) so does `finetune merge`'s merged model, loaded with
transformers. Tied embeddings stay tied in every export. Each run takes a second or two; a merge about four (its
check reloads the merged model in a fresh process), hence one.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.registry import SUPPORTED_MODELS
from finetune.storage import rundir
from finetune.storage.metrics import read_metrics
from tests.cli_helpers import main_exit
from tests.integration.conftest import DATA, cli_exit_code, tiny_recipe, write_named
from tests.moe_rows import MOE_ROWS

pytestmark = pytest.mark.integration

# the text decoder rows that load a checkpoint folder (debug rows build their tiny config; custom rows have none)
# the mixture-of-experts rows train from their folders in tests/integration/test_moe.py (with the router loss)
FAMILIES = sorted(name for name, row in SUPPORTED_MODELS.items()
                  if row.task == "causal_lm" and not row.debug_build and row.factory is None and name not in MOE_ROWS)
GOLDEN_LOSSES = {
    "gemma2": [6.1862993240356445, 6.139245578220913],
    "gemma3_text": [6.175604152679443, 6.175193922860282],
    "gpt2": [6.255719947814941, 6.2899385179792136],
    "granite": [6.243744277954102, 6.237822941371372],
    "llama": [6.240268516540527, 6.216217041015625],
    "mistral": [6.240268516540527, 6.216217041015625],  # the tiny config is llama's, and no window: llama's losses
    "olmo2": [6.230922412872315, 6.185891832624163],
    "olmo3": [6.215412521362305, 6.190529142107282],
    "phi3": [6.265907096862793, 6.20017283303397],
    "qwen2": [6.209135055541992, 6.166191782270159],
    "qwen3": [6.2314447402954105, 6.224634715488979],
    "smollm3": [6.25420913696289, 6.2304961340768],
}
LORA = {"method": "lora", "preset": "attn_mlp", "r": 8, "alpha": 16, "dropout": 0.0}
# the rows `finetune merge` merges here: a family that ties its embeddings (and soft-caps its logits); the merge is
# the same for every family (peft merges each adapted linear layer) and tests/integration/test_lora.py merges Llama
MERGED = ("gemma2",)


def checkpoint_folder(root: Path, name: str) -> Path:
    """``root/<name>-hub``: the row's tiny config with weights from seed 0 and the bundled tiny tokenizer, saved as
    the hub ships a model."""
    import transformers

    from finetune.config.schema import ModelConfig
    from finetune.registry import get_model
    from finetune.runtime.modeling import build_tokenizer, save_tokenizer

    row = SUPPORTED_MODELS[name]
    folder = root / f"{name}-hub"
    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    getattr(transformers, row.auto_class).from_config(config).save_pretrained(folder)
    save_tokenizer(build_tokenizer(ModelConfig(type="tiny-llama"), get_model("tiny-llama")), folder)
    return folder


def family_recipe(name: str, folder: Path, **sections: Any) -> dict[str, Any]:
    """Two short steps of chat SFT of ``folder`` as model.type ``name``, a checkpoint (with its recorded logits) at
    the last, no eval."""
    base = tiny_recipe(model={"type": name, "path": str(folder)},
                       data={"format": "chat", "train": str(DATA / "tiny_chat.jsonl"), "eval": None,
                             "max_seq_len": 64, "overlong": "truncate"},
                       train={"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2},
                       checkpoint={"every_steps": 2})
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def train(root: Path, run: str, recipe: dict[str, Any]) -> Path:
    code = cli_exit_code("run", str(write_named(root, run, recipe)))
    assert code == 0, f"`finetune run` of {run} exited {code}"
    return root / run


def logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits


def assert_tied_as_configured(model: Any) -> None:
    """The output head shares the input embedding's weight exactly when the config ties them."""
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == bool(model.config.get_text_config().tie_word_embeddings)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_trains_full_and_lora_from_its_checkpoint_folder(name: str, tmp_path: Path, monkeypatch,
                                                                    capsys) -> None:
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    from finetune.storage.checkpoints import read_state

    row = SUPPORTED_MODELS[name]
    folder = checkpoint_folder(tmp_path, name)

    full = train(tmp_path, "full", family_recipe(name, folder))
    losses = [r["loss"] for r in read_metrics(full) if r["kind"] == "train"]
    assert losses == pytest.approx(GOLDEN_LOSSES[name], rel=1e-5, abs=0), (name, losses)
    model = transformers.AutoModelForCausalLM.from_pretrained(full / "final")
    assert model.config.model_type in row.model_types
    assert_tied_as_configured(model)
    recorded = read_state(rundir.step_dir(full, 2), "probe")
    assert float((logits(model, recorded) - recorded["logits"]).abs().max()) <= 1e-5

    lora = train(tmp_path, "lora", family_recipe(name, folder, peft=LORA, optim={"lr": 5e-3},
                                                  checkpoint={"every_steps": None}))
    adapter = load_file(str(lora / "final" / "adapter_model.safetensors"))
    for target in row.lora_targets["attn_mlp"]:  # every module of the preset was adapted, nothing else
        assert any(f".{target}.lora_A" in key for key in adapter), target
    check = load_file(str(lora / "final" / rundir.MERGE_CHECK))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    adapted = PeftModel.from_pretrained(base, str(lora / "final"))
    assert float((logits(adapted, check) - check["logits"]).abs().max()) <= 1e-5
    if name not in MERGED:
        return
    code, _, err = main_exit(monkeypatch, capsys, "merge", str(lora), "-o", str(tmp_path / "merged"))
    assert code == 0, err
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert_tied_as_configured(merged)
    assert float((logits(merged, check) - check["logits"]).abs().max()) <= 1e-5
