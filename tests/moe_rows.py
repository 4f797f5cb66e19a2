"""The mixture-of-experts rows for tests (tests/unit/test_router.py, test_plan.py, test_modeling.py,
tests/integration/test_moe.py, tests/distributed/test_registry.py): a tiny pretrained folder of each, made from
the row's tiny config (seed 0) with the bundled tiny-llama tokenizer, as a hub checkpoint looks (GPT-OSS's experts
in MXFP4, as OpenAI ships them); nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

MOE_ROWS = ("mixtral", "qwen3_moe", "gpt_oss")
TOKENIZER = Path(__file__).resolve().parents[1] / "finetune" / "assets" / "tiny-llama-tokenizer"
# E2M1, the 4-bit float of MXFP4: the low 3 bits index the magnitude, the high bit is the sign (the OCP MX spec)
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def tiny_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random model of row ``name`` from its tiny config (with ``overrides``), seeded."""
    import transformers

    from finetune.registry import SUPPORTED_MODELS

    row = SUPPORTED_MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, row.config_class)(**{**row.tiny_config, **overrides})
    return getattr(transformers, row.auto_class).from_config(config)


def pretrained(folder: Path, name: str, mxfp4: bool | None = None) -> Path:
    """``folder``: the tiny model of row ``name`` saved with the tiny-llama tokenizer; GPT-OSS's experts as MXFP4
    blocks and scales (``mxfp4``; default: for gpt_oss only), as its hub checkpoints hold them. Made once."""
    import transformers

    if (folder / "config.json").is_file():
        return folder
    tiny_model(name).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(folder)
    if mxfp4 if mxfp4 is not None else name == "gpt_oss":
        quantize_experts(folder)
    return folder


def quantize_experts(folder: Path, seed: int = 1) -> None:
    """Replace the experts' weights of a saved GPT-OSS model by random MXFP4 blocks and scales (the layout of its
    hub checkpoint: ``<name>_blocks`` uint8 ``[experts, out, in/32, 16]``, two 4-bit values a byte, low nibble first,
    and ``<name>_scales`` uint8 ``[experts, out, in/32]``, a power of two biased by 127) and declare them in
    config.json, as OpenAI's checkpoints do."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    stored = {}
    for key, value in weights.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = value.shape
            stored[f"{key}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator,
                                                    dtype=torch.uint8)
            stored[f"{key}_scales"] = torch.randint(115, 122, (experts, outputs, inputs // 32), generator=generator,
                                                    dtype=torch.uint8)
        else:
            stored[key] = value
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weights MXFP4 ``blocks`` and ``scales`` stand for, written from the format's definition: each byte two
    E2M1 values (low nibble first), each block of 32 times 2**(scale - 127); laid out ``[experts, in, out]`` as the
    model's parameter."""
    magnitude = torch.tensor(FP4, dtype=torch.float64)
    nibbles = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., 16, 2]: low, high
    values = magnitude[nibbles & 0x7] * torch.where(nibbles >= 8, -1.0, 1.0).double()
    values = values.flatten(-2) * torch.pow(2.0, scales.double() - 127)[..., None]  # [..., in/32, 32]
    experts, outputs = blocks.shape[:2]
    return values.reshape(experts, outputs, -1).transpose(1, 2)
