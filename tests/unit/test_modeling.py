"""finetune.runtime.modeling: what building a model sets for the process beyond the model itself."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from finetune import registry
from finetune.config.schema import ModelConfig
from finetune.runtime.modeling import build_model

ROW = registry.get_model("tiny-llama")


@pytest.fixture
def cudnn_sdpa_restored() -> Iterator[None]:
    """torch's cuDNN attention switch is process-wide: put back what it was."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.usefixtures("cudnn_sdpa_restored")
@pytest.mark.parametrize("attn", [None, "sdpa", "eager"])
def test_building_a_model_keeps_attention_off_cudnn(attn: str | None) -> None:
    """On a Hopper GPU, sdpa's cuDNN backend builds a plan for every new shape (2.7 ms of host time per call on an
    H200; a fine-tuning run has new shapes at nearly every step): the GPU check measured a hand-written packed loop at
    9.1k tokens/s with it and 21.3k without. Every model finetune builds (train, eval, generate) turns it off; the
    flash and memory-efficient kernels stay."""
    assert torch.backends.cuda.cudnn_sdp_enabled()
    build_model(ModelConfig(type="tiny-llama", attn_implementation=attn), ROW)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


def test_max_seq_len_beyond_the_positions_a_rotary_model_was_trained_for_is_one_line(llama, tok) -> None:
    """A rotary model has no position table to overflow, but its config says how far it was trained: a longer
    data.max_seq_len is refused naming both numbers and the fix; up to it is accepted."""
    from finetune.errors import ConfigError
    from finetune.runtime.modeling import check_fits, position_limit

    assert position_limit(llama.config) == 2048  # LlamaConfig's default: the tiny config names none
    check_fits(llama, tok, 2048)
    with pytest.raises(ConfigError, match=r"^data.max_seq_len=2049 is longer than the 2048 positions this model was "
                                          r"trained for \(max_position_embeddings in its config\); set "
                                          r"data.max_seq_len to at most 2048"):
        check_fits(llama, tok, 2049)
    assert position_limit(object()) is None  # a custom model's config names none


MESSAGES = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def test_a_recipe_chat_template_is_the_tokenizers_and_part_of_its_fingerprint(bare_tokenizer, tmp_path) -> None:
    """model.chat_template gives a model whose tokenizer has none a template (a named one or a file), and replaces
    a tokenizer's own: every render then goes through it, and the fingerprint a resume compares holds it."""
    from finetune.config.chat_templates import CHATML
    from finetune.runtime.modeling import build_tokenizer
    from finetune.storage.checkpoints import tokenizer_fingerprint

    bare = build_tokenizer(ModelConfig(type="tiny-llama", path=str(bare_tokenizer)), ROW)
    assert bare.chat_template is None
    named = build_tokenizer(ModelConfig(type="tiny-llama", path=str(bare_tokenizer), chat_template="chatml"), ROW)
    assert named.chat_template == CHATML
    assert named.apply_chat_template(MESSAGES, tokenize=False) == "<|im_start|>user\n2+2?<|im_end|>\n" \
                                                                  "<|im_start|>assistant\n4<|im_end|>\n"
    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    own = build_tokenizer(ModelConfig(type="tiny-llama"), ROW)  # the bundled tokenizer has a template of its own
    replaced = build_tokenizer(ModelConfig(type="tiny-llama", chat_template=str(mine)), ROW)
    assert own.chat_template and own.chat_template != replaced.chat_template == mine.read_text()
    assert replaced.apply_chat_template(MESSAGES, tokenize=False) == "[user] 2+2?\n[assistant] 4\n"
    prints = {tokenizer_fingerprint(t) for t in (bare, named, own, replaced)}
    assert len(prints) == 4, "a tokenizer's fingerprint must change with its chat template"
    mine.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # the same path, another text
    edited = build_tokenizer(ModelConfig(type="tiny-llama", chat_template=str(mine)), ROW)
    assert tokenizer_fingerprint(edited) not in prints


def test_an_export_keeps_the_template_it_was_saved_with(bare_tokenizer, tmp_path) -> None:
    """An export's tokenizer (``source``) is read as saved: the recipe's template file may have changed or gone."""
    from finetune.runtime.modeling import build_tokenizer, save_tokenizer

    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    cfg = ModelConfig(type="tiny-llama", path=str(bare_tokenizer), chat_template=str(mine))
    save_tokenizer(build_tokenizer(cfg, ROW), tmp_path / "export")
    mine.unlink()
    assert build_tokenizer(cfg, ROW, source=str(tmp_path / "export")).apply_chat_template(
        MESSAGES, tokenize=False) == "<user>2+2?<assistant>4"


def test_a_template_that_does_not_compile_or_is_gone_is_one_line(tmp_path) -> None:
    from finetune.errors import ConfigError
    from finetune.runtime.modeling import build_tokenizer

    broken, gone = tmp_path / "broken.jinja", tmp_path / "gone.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ConfigError, match=rf"^{re.escape(f'model.chat_template: {broken}')} is not a valid Jinja chat "
                                          r"template \(line 2: [^\n]+\)$"):
        build_tokenizer(ModelConfig(type="tiny-llama", chat_template=str(broken)), ROW)
    with pytest.raises(ConfigError, match=f"^{re.escape(f'model.chat_template: file not found: {gone}')}$"):
        build_tokenizer(ModelConfig(type="tiny-llama", chat_template=str(gone)), ROW)


# --- GPT-OSS: MXFP4 checkpoints and attention sinks ----------------------------------------------------------------


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory: pytest.TempPathFactory):
    """A tiny GPT-OSS checkpoint whose experts are MXFP4 blocks and scales, as on the hub (tests/moe_rows.py)."""
    from tests.moe_rows import pretrained

    return pretrained(tmp_path_factory.mktemp("oss") / "gpt-oss", "gpt_oss")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_mxfp4_checkpoint_loads_dequantized_to_the_training_dtype(mxfp4_folder, dtype: str) -> None:
    """Every expert weight is the value its 4-bit block and power-of-two scale stand for (the format written out
    in tests/moe_rows.py), in model.dtype, trainable; the model forgets the quantization (its export is plain) and
    train.log says what happened."""
    from safetensors.torch import load_file

    from finetune.runtime.modeling import prequantized
    from tests.moe_rows import dequantize

    cfg = ModelConfig(type="gpt_oss", path=str(mxfp4_folder), dtype=dtype)
    model = build_model(cfg, registry.get_model("gpt_oss"))
    stored = load_file(str(mxfp4_folder / "model.safetensors"))
    experts = {name: p for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))}
    assert len(experts) == 4
    for name, param in experts.items():
        assert param.dtype == getattr(torch, dtype) and param.requires_grad
        expected = dequantize(stored[f"{name}_blocks"], stored[f"{name}_scales"]).to(param.dtype)
        assert torch.equal(param.detach(), expected), name
    assert not hasattr(model.config, "quantization_config") and not getattr(model, "is_quantized", False)
    assert prequantized(cfg) == (f"model.path: the checkpoint's MXFP4 weights are dequantized to {dtype} for "
                                 f"training (the export holds {dtype} weights)")
    assert prequantized(ModelConfig(type="gpt_oss")) is None


def test_qlora_over_an_mxfp4_checkpoint_is_one_line(mxfp4_folder) -> None:
    from finetune.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^peft.method=qlora: .* holds MXFP4-quantized weights .*; use "
                                          r"peft.method=lora$"):
        build_model(ModelConfig(type="gpt_oss", path=str(mxfp4_folder)), registry.get_model("gpt_oss"),
                    quantization=object())


def test_attention_paths_that_would_lose_gpt_oss_sinks_are_refused() -> None:
    """flash-attn 2 takes no sinks (transformers would drop them silently): refused before any weight is read; sdpa
    is refused by transformers for GPT-OSS, as one line; the eager default keeps them: the sinks change the logits.
    Another MoE row without sinks passes the flash check."""
    import transformers

    from finetune.errors import ConfigError
    from finetune.runtime.modeling import build_config, keeps_sinks

    oss = registry.get_model("gpt_oss")
    flash = ModelConfig(type="gpt_oss", attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match=r"^model.attn_implementation: flash_attention_2 \(the flash-attn 2 "
                                          r"package\) drops the attention sinks of gpt_oss; use eager"):
        keeps_sinks(flash, oss, build_config(ModelConfig(type="gpt_oss"), oss))
    mixtral = registry.get_model("mixtral")
    keeps_sinks(ModelConfig(type="mixtral", attn_implementation="flash_attention_2"), mixtral,
                build_config(ModelConfig(type="mixtral"), mixtral))
    with pytest.raises(ConfigError, match=r"^model.attn_implementation: gpt_oss cannot use sdpa"):
        build_model(ModelConfig(type="gpt_oss", attn_implementation="sdpa"), oss)
    model = build_model(ModelConfig(type="gpt_oss"), oss).eval()
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(5, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.add_(3.0)
        assert not torch.allclose(model(input_ids=ids).logits, before, atol=1e-4)
    assert isinstance(model, transformers.GptOssForCausalLM)


def test_sdpa_is_refused_in_one_line_where_attention_is_soft_capped() -> None:
    """Gemma 2 soft-caps its attention scores, which sdpa cannot: its class refuses sdpa when built (one line naming
    the key), its default is eager; a Gemma 3 config that sets a cap would build with sdpa, its default, and fail at
    the first forward: refused when built too, and eager builds."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2ForCausalLM

    from finetune.errors import ConfigError

    gemma2, gemma3 = registry.get_model("gemma2"), registry.get_model("gemma3_text")
    with pytest.raises(ConfigError, match=r"^model.attn_implementation: gemma2 cannot use sdpa \(Gemma2ForCausalLM "
                                          r"does not support an attention implementation through torch"):
        build_model(ModelConfig(type="gemma2", attn_implementation="sdpa"), gemma2)
    assert not Gemma2ForCausalLM._supports_sdpa
    overrides = {"attn_logit_softcapping": 50.0}
    with pytest.raises(ConfigError, match=re.escape(
            "model.attn_implementation: gemma3_text soft-caps its attention scores (attn_logit_softcapping=50.0), "
            "which sdpa cannot; set model.attn_implementation to eager, flex_attention or flash_attention_2")):
        build_model(ModelConfig(type="gemma3_text", config_overrides=overrides), gemma3)
    model = build_model(ModelConfig(type="gemma3_text", config_overrides=overrides, attn_implementation="eager"),
                        gemma3)
    assert model.config._attn_implementation == "eager"
