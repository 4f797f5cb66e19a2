"""Fixtures shared by the unit tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512}
TOKENIZER = Path(__file__).resolve().parents[2] / "finetune" / "assets" / "tiny-llama-tokenizer"


@pytest.fixture(scope="module")
def tok() -> Any:
    """The bundled tiny-llama tokenizer, loaded once per test module."""
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope="module")
def llama() -> Any:
    """A tiny random Llama (seed 0) in eval mode, with the bundled tokenizer's special ids."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LLAMA, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tools() -> tuple:
    """The tiny Qwen2-VL row's tokenizer and image inputs (tests.vision_rows), built once per test module."""
    from finetune.config.schema import ModelConfig
    from finetune.runtime.modeling import build_tokenizer, image_inputs
    from tests.vision_rows import ROW

    tokenizer = build_tokenizer(ModelConfig(type="tiny-qwen2-vl"), ROW)
    return tokenizer, image_inputs(tokenizer, ROW)


@pytest.fixture
def bare_tokenizer(tmp_path: Path) -> Path:
    """A folder holding the bundled tiny-llama tokenizer without its chat template (the asset has one): a model
    whose tokenizer has none."""
    folder = tmp_path / "bare-tokenizer"
    shutil.copytree(TOKENIZER, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert transformers.AutoTokenizer.from_pretrained(str(folder)).chat_template is None
    return folder
