"""finetune.runtime.materialize without processes: which rank reads pretrained weights under which backend, and that the
model a rank builds without reading them is the model ``from_pretrained`` gives, down to ties and buffers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from finetune.backends import backend_named
from finetune.config.schema import ModelConfig
from finetune.errors import ConfigError
from finetune.registry import SUPPORTED_MODELS
from finetune.runtime import materialize
from finetune.runtime.modeling import ASSETS, build_model

BACKENDS = ["single", "ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3", "zero3_offload"]
EXPECTED = {"single": "everywhere", "ddp": "broadcast", "fsdp1": "broadcast", "fsdp2": "shard", "zero1": "broadcast",
            "zero2": "broadcast", "zero3": "library", "zero3_offload": "library"}


@pytest.mark.parametrize("name", BACKENDS)
def test_the_plan_per_backend(name: str) -> None:
    """Pretrained weights on 2 processes: each backend's way; rank 0 always builds with weights, rank 1 builds
    empty exactly where it then receives them."""
    backend = backend_named(name)
    for rank in (0, 1):
        plan = materialize.plan(backend, 2, rank, pretrained=True, quantized=False, env={})
        assert plan.strategy == EXPECTED[name]
        assert plan.builds_empty == (rank == 1 and EXPECTED[name] in ("broadcast", "shard"))


@pytest.mark.parametrize("name", BACKENDS)
def test_what_keeps_the_plain_build(name: str) -> None:
    """One process, a config-built model, QLoRA, and FINETUNE_LOAD_EVERYWHERE=1 (but under ZeRO-3, where the
    library's own load is the plain build) leave every rank building its model as before."""
    backend = backend_named(name)
    cases = {"one process": materialize.plan(backend, 1, 0, True, False, {}),
             "config-built": materialize.plan(backend, 2, 1, False, False, {}),
             "QLoRA": materialize.plan(backend, 2, 1, True, True, {})}
    for why, plan in cases.items():
        assert plan.strategy == "everywhere" and not plan.builds_empty and not plan.collective, why
    escaped = materialize.plan(backend, 2, 1, True, False, {materialize.ENV: "1"})
    assert escaped.strategy == ("library" if EXPECTED[name] == "library" else "everywhere")
    assert not escaped.builds_empty and not escaped.collective


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("YES", True), ("0", False), ("", False),
                                           ("no", False)])
def test_the_escape_hatch_values(value: str, on: bool) -> None:
    assert materialize.load_everywhere({materialize.ENV: value}) is on
    assert materialize.load_everywhere({}) is False


@pytest.mark.parametrize("world", [1, 2])
def test_a_bad_escape_hatch_value_is_one_line_naming_the_variable(world: int) -> None:
    """Refused whatever the run would do with it (here: one process, which reads everywhere anyway)."""
    with pytest.raises(ConfigError) as caught:
        materialize.plan(backend_named("ddp"), world, 0, True, False, {materialize.ENV: "maybe"})
    message = str(caught.value)
    assert message.startswith(f"{materialize.ENV}='maybe'") and "use 1" in message and "\n" not in message


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A tiny llama with tied embeddings saved like a hub checkpoint (config, safetensors, tokenizer)."""
    out = tmp_path_factory.mktemp("tied-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SUPPORTED_MODELS["llama"].tiny_config, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(out)
    return out


def _cfg(path: Path, **extra: object) -> ModelConfig:
    return ModelConfig(type="llama", path=str(path), **extra)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_empty_build_is_the_pretrained_model_without_its_weights(pretrained: Path, dtype: str) -> None:
    """Same names, shapes, dtypes, ties, buffers and mode as from_pretrained; every tensor on the meta device until
    it is given storage, after which the embedding is still tied and has real (CPU) storage."""
    row = SUPPORTED_MODELS["llama"]
    loaded = build_model(_cfg(pretrained, dtype=dtype), row)
    empty = build_model(_cfg(pretrained, dtype=dtype), row, empty=True)
    assert all(t.is_meta for t in [*empty.parameters(), *empty.buffers()])
    assert materialize.signature(empty) == materialize.signature(loaded)
    filled = materialize.materialize_empty(empty)
    assert materialize.signature(filled) == materialize.signature(loaded)
    assert filled.lm_head.weight is filled.model.embed_tokens.weight
    assert not any(t.is_meta for t in [*filled.parameters(), *filled.buffers()])
    assert "param lm_head.weight" not in materialize.signature(filled)  # shared: listed once, under the embedding


def test_the_empty_build_reads_no_weights(pretrained: Path, tmp_path: Path) -> None:
    """A folder without its weight file still gives the empty model (only config.json is read), where loading the
    weights fails."""
    folder = tmp_path / "no-weights"
    shutil.copytree(pretrained, folder)
    (folder / "model.safetensors").unlink()
    row = SUPPORTED_MODELS["llama"]
    empty = build_model(_cfg(folder), row, empty=True)
    assert materialize.signature(empty) == materialize.signature(build_model(_cfg(pretrained), row))
    with pytest.raises(ConfigError, match=r"model\.path: cannot load the model weights"):
        build_model(_cfg(folder), row)


def test_what_has_no_empty_form(pretrained: Path) -> None:
    """A config-built model, QLoRA and a custom factory row are refused (the plan never asks for them)."""
    row = SUPPORTED_MODELS["llama"]
    for cfg, quantization in ((ModelConfig(type="llama"), None), (_cfg(pretrained), object())):
        with pytest.raises(ValueError, match="an empty model"):
            build_model(cfg, row, quantization=quantization, empty=True)


def test_signatures_show_ties_modes_and_the_first_difference(pretrained: Path) -> None:
    """An untied checkpoint (both matrices present) differs from its tied config in the parameter list, and the
    message names the first differing line; train/eval mode and trainability are part of the signature."""
    row = SUPPORTED_MODELS["llama"]
    tied = build_model(_cfg(pretrained), row)
    untied = build_model(_cfg(pretrained, config_overrides={"tie_word_embeddings": False}), row)
    a, b = materialize.signature(tied), materialize.signature(untied)
    assert a != b and "param lm_head.weight" in b
    difference = materialize.first_difference(a, b, 3)  # (mine, rank 0's): the tied rank lists a buffer there
    assert difference.startswith("rank 0 has param lm_head.weight (512, 64) torch.float32 grad, rank 3 buffer "
                                 "model.rotary_emb.inv_freq"), difference
    assert materialize.first_difference(a, a, 1) == ""
    assert materialize.first_difference(a, a + "\nbuffer x (1,) torch.float32", 1).endswith(", rank 1 nothing")
    assert materialize.signature(tied.train()) != a
    tied.eval().model.norm.weight.requires_grad_(False)
    assert "param model.norm.weight (64,) torch.float32 frozen" in materialize.signature(tied)


def test_persistent_buffers_are_listed(pretrained: Path) -> None:
    """The Llama rows keep only non-persistent buffers (rotary frequencies); a persistent one is listed, which
    makes FSDP2 fill the model by broadcast."""
    model = build_model(_cfg(pretrained), SUPPORTED_MODELS["llama"])
    assert materialize.persistent_buffers(model) == []
    assert {name for name, _ in model.named_buffers()} >= {"model.rotary_emb.inv_freq"}
    model.model.register_buffer("scale", torch.ones(2), persistent=True)
    assert materialize.persistent_buffers(model) == ["model.scale"]
