"""finetune.runtime.flops against torch's own count: ``FlopCounterMode`` around a real forward + backward on CPU.

Eager attention is used because FlopCounterMode has no formula for torch's CPU flash kernel; eager's two batched
matmuls per layer are what the formula's attention term counts. Each case checks within 5%; the frozen cases also
check that plain 6N would have been wrong, so the test can tell a formula that ignores trainability.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from finetune.registry import SUPPORTED_MODELS
from finetune.runtime import flops

BATCH, SEQ = 2, 48


def _build(row: str, **overrides: object) -> torch.nn.Module:
    spec = SUPPORTED_MODELS[row]
    config = getattr(transformers, spec.config_class)(**{**spec.tiny_config, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _measured(model: torch.nn.Module) -> int:
    ids = torch.randint(0, 500, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        out = model(input_ids=ids, use_cache=False)
        out.logits.float().sum().backward()
    return counter.get_total_flops()


def _formula(model: torch.nn.Module) -> int:
    config = model.config
    tied = config.tie_word_embeddings and model.get_output_embeddings() is not None
    head = model.get_output_embeddings().weight.numel() if tied else 0
    got = flops.train_flops(flops.params_of(model), flops.attention_of(config), [SEQ] * BATCH, tied_head_numel=head)
    assert got is not None
    return got


def _six_n(model: torch.nn.Module) -> int:
    """What a formula blind to trainability says: 6 x every matmul weight (head included) x tokens, + attention."""
    names = ("embed", "wte", "wpe")
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and not any(e in n for e in names))
    if model.config.tie_word_embeddings:
        matmul += model.get_output_embeddings().weight.numel()
    attn = flops.attention_of(model.config)
    return 6 * matmul * BATCH * SEQ + 12 * attn.layers * attn.query_width * BATCH * SEQ ** 2


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft
    targets = list(SUPPORTED_MODELS["tiny-llama"].lora_targets["attn_mlp"])
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))


def _freeze_bottom(model: torch.nn.Module) -> torch.nn.Module:
    model.get_input_embeddings().weight.requires_grad_(False)
    for layer in model.model.layers[:2]:
        for p in layer.parameters():
            p.requires_grad_(False)
    return model


CASES = {
    "tiny-llama": lambda: _build("tiny-llama"),
    "tiny-llama, untied head, 4 layers": lambda: _build("tiny-llama", num_hidden_layers=4, tie_word_embeddings=False),
    "qwen2 (q/k/v bias)": lambda: _build("qwen2"),
    "gpt2 (Conv1D, fused qkv)": lambda: _build("gpt2"),
    "phi3 (fused qkv_proj and gate_up_proj)": lambda: _build("phi3"),
    "qwen3 (q and k norms)": lambda: _build("qwen3"),
    "gemma2 (four norms a layer)": lambda: _build("gemma2"),
    "olmo2 (post-norms)": lambda: _build("olmo2"),
    "olmo2 LoRA attn_mlp": lambda: _lora(_build("olmo2")),
    "tiny-llama LoRA attn_mlp": lambda: _lora(_build("tiny-llama")),
    "tiny-llama, embedding and layers 0-1 frozen": lambda: _freeze_bottom(_build("tiny-llama", num_hidden_layers=3)),
}
FROZEN = {"tiny-llama LoRA attn_mlp", "tiny-llama, embedding and layers 0-1 frozen", "olmo2 LoRA attn_mlp"}


@pytest.mark.parametrize("case", list(CASES))
def test_formula_matches_flop_counter(case: str) -> None:
    model = CASES[case]()
    measured, formula = _measured(model), _formula(model)
    assert formula == pytest.approx(measured, rel=0.05), (case, formula, measured)
    if case in FROZEN:  # 6N counts weight gradients the frozen parts never compute: it would fail this test
        assert abs(_six_n(model) - measured) > 0.2 * measured, (case, _six_n(model), measured)
    else:
        assert _six_n(model) == pytest.approx(measured, rel=0.05)


def test_packed_samples_count_their_own_attention() -> None:
    """A packed row of samples s_i costs sum(s_i^2) of attention, not (sum s_i)^2: MFU counts useful work."""
    model = _build("tiny-llama")
    params, attn = flops.params_of(model), flops.attention_of(model.config)
    head = model.get_output_embeddings().weight.numel()
    one = flops.train_flops(params, attn, [64], tied_head_numel=head)
    two = flops.train_flops(params, attn, [32, 32], tied_head_numel=head)
    assert one is not None and two is not None
    assert one - two == 12 * attn.layers * attn.query_width * (64 ** 2 - 2 * 32 ** 2)


def test_meta_model_and_unknown_parts() -> None:
    """The formula reads a meta-device build (no memory); a model with a part it does not know gives None."""
    spec = SUPPORTED_MODELS["tiny-llama"]
    config = transformers.LlamaConfig(**spec.tiny_config)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    real = _build("tiny-llama")
    assert flops.params_of(meta) == flops.params_of(real)
    vlm = SUPPORTED_MODELS["tiny-qwen2-vl"]
    with torch.device("meta"):
        vision = transformers.AutoModelForImageTextToText.from_config(
            transformers.Qwen2VLConfig(**vlm.tiny_config))
    assert flops.train_flops(flops.params_of(vision), flops.attention_of(vision.config), [8]) is None


def test_peak_table() -> None:
    assert flops.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert flops.peak_flops("NVIDIA H100 NVL") is None  # known, not tabulated: omitted, not the SXM figure
    assert flops.peak_flops("NVIDIA H200") == 989e12
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops.peak_flops("NVIDIA L40S") == 362e12
    assert flops.peak_flops("NVIDIA A10G") == 125e12
    assert flops.peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert flops.peak_flops("NVIDIA GeForce RTX 4090 D") is None
    assert flops.peak_flops("Tesla T4") is None and flops.peak_flops(None) is None
    assert flops.peak_flops("Tesla T4", override_tflops=65.0) == 65e12
    assert flops.mfu(494.5e12, 989e12) == pytest.approx(0.5) and flops.mfu(1.0, None) is None
