"""finetune.config.families: ``model.type`` read from a model's config.json when a recipe leaves it out, and the row
derived for a causal LM whose family has no row (FSDP wrap class, LoRA presets, conservative capabilities), refused in
one line for anything else.

The families used here have no row and none is planned (gpt_neox, falcon, starcoder2, olmoe); their models are built
by transformers itself on the meta device from a config.json written here, so nothing is downloaded or loaded. What a
derived row claims is checked against transformers' own answers (its classes' flags, the modules of the model it
builds) and against plain rules written here (a module under ``.attention.`` is an attention projection)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from finetune import registry
from finetune.config import families
from finetune.config.schema import ModelConfig, PeftConfig
from finetune.errors import ConfigError

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 512, "max_position_embeddings": 512}


@pytest.fixture(autouse=True)
def no_derived_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no derived row (a row derived in a test stays out of the next one)."""
    monkeypatch.setattr(registry, "DERIVED", {})


def config_folder(folder: Path, model_type: str, **values: Any) -> Path:
    """``folder`` holding only the config.json transformers writes for ``model_type`` with ``values`` (no weights:
    a row is derived from the config alone)."""
    transformers.AutoConfig.for_model(model_type, **values).save_pretrained(folder)
    return folder


def derived(tmp_path: Path, model_type: str, **values: Any) -> registry.SupportedModel:
    """The row derived for a config-only folder of ``model_type`` (model.type left out)."""
    model = ModelConfig(path=str(config_folder(tmp_path / model_type, model_type, **{**TINY, **values})))
    families.resolve(model)
    assert model.type == model_type
    return registry.get_model(model_type)


# --- model.type from config.json -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model_type", "row"), [("llama", "llama"), ("qwen2_vl", "qwen2_vl"), ("bert", "bert")])
def test_a_left_out_type_is_the_row_that_lists_the_configs_model_type(tmp_path: Path, model_type: str,
                                                                      row: str) -> None:
    """llama and the debug tiny-llama both list llama (qwen2_vl and tiny-qwen2-vl likewise): the non-debug row."""
    listing = [r.name for r in registry.SHIPPED.values() if model_type in r.model_types]  # not a plugin's rows
    assert row in listing and (model_type == "bert" or len(listing) == 2)  # the rule is tested on a real choice
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    model = ModelConfig(path=str(tmp_path))
    families.resolve(model)
    assert model.type == row and not registry.DERIVED


def test_of_several_rows_the_one_named_like_the_type_then_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    llama = registry.SUPPORTED_MODELS["llama"]
    table = {name: dataclasses.replace(llama, name=name) for name in ("a-llama", "b-llama", "llama")}
    monkeypatch.setattr(registry, "SUPPORTED_MODELS", table)
    assert families.table_row("llama").name == "llama"
    del table["llama"]
    assert families.table_row("llama").name == "a-llama"  # the first in the table
    table["a-llama"] = dataclasses.replace(llama, name="a-llama", debug_build=True)
    assert families.table_row("llama").name == "b-llama"  # a debug row last
    assert families.table_row("gpt_neox") is None


def test_a_hub_repository_s_config_is_read_from_the_cache_offline(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """model.path: org/name with only its config.json in the hub cache (as `finetune plan` reads it)."""
    import huggingface_hub.constants

    for name, config in (("small", {"model_type": "qwen2"}),
                         ("neox", transformers.GPTNeoXConfig(**TINY).to_dict())):
        snapshot = tmp_path / "hub" / f"models--acme--{name}" / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text("abc123")
        (snapshot / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = ModelConfig(path="acme/small")
    families.resolve(model)
    assert model.type == "qwen2"
    model = ModelConfig(path="acme/neox")  # a family without a row: derived from the cached config alone
    families.resolve(model)
    assert model.type == "gpt_neox" and registry.get_model("gpt_neox").decoder_layer == "GPTNeoXLayer"
    with pytest.raises(ConfigError, match=r"^model.path: cannot read config.json of the hub repository acme/other "
                                          r"to learn the model type \(.*\); check the name .*set model.type$"):
        families.resolve(ModelConfig(path="acme/other"))


@pytest.mark.parametrize(("path", "expected"), [
    (None, "model.type: not set, and model.path is null (nothing to read the model type from); set model.type"),
    ("pkg://somepkg", "model.type: not set; finetune reads it from the config.json of a folder or a hub repository"),
    ("missing/folder/x", "model.path: folder not found: missing/folder/x"),
    ("empty", "model.path: empty has no config.json to read the model type from; give a Hugging Face model folder, "
              "or set model.type"),
    ("no-type", "has no model_type; it is not a Hugging Face model config"),
])
def test_a_type_that_cannot_be_read_is_one_line_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              path: str | None, expected: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-type").mkdir()
    (tmp_path / "no-type" / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(ConfigError) as info:
        families.resolve(ModelConfig(path=path))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_given_type_that_is_a_row_reads_nothing(tmp_path: Path) -> None:
    model = ModelConfig(type="llama", path=str(tmp_path / "not-there"))
    families.resolve(model)  # the folder is validation's to check (_model_folder_lines)
    assert model.type == "llama"


# --- derived rows ----------------------------------------------------------------------------------------------------


def linear_names(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def test_a_causal_lm_without_a_row_gets_a_row_from_its_transformers_class(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """gpt_neox: the FSDP unit, capabilities and inputs are transformers' own answers; the row is valid data that
    only this process holds (the table, and so `finetune models` and the docs, are unchanged)."""
    table = dict(registry.SUPPORTED_MODELS)
    row = derived(tmp_path, "gpt_neox")
    cls = transformers.GPTNeoXForCausalLM
    assert (row.name, row.task, row.model_types, row.auto_class) == ("gpt_neox", "causal_lm", ("gpt_neox",),
                                                                     "AutoModelForCausalLM")
    assert row.wrap_classes == tuple(cls._no_split_modules) == ("GPTNeoXLayer",)
    assert row.capabilities == {"generation", "gradient_checkpointing"}
    assert cls.can_generate() and cls.supports_gradient_checkpointing
    assert row.model_inputs == ("input_ids", "attention_mask", "position_ids") and row.output_head is None
    assert registry.row_problem(row) is None and table == registry.SUPPORTED_MODELS
    assert registry.get_model("gpt_neox", "sft") is row
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: model.type: gpt_neox has no row in finetune's table "
                                                   "of tested model families (docs/reference/models.md)")
    assert "untested" in err and "model.plugin" in err and "docs/architecture.md" in err


@pytest.mark.parametrize(("model_type", "values", "attention", "mlp"), [
    ("gpt_neox", {}, ".attention.", ".mlp."),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, ".self_attention.", ".mlp."),
    ("starcoder2", {"num_key_value_heads": 2}, ".self_attn.", ".mlp."),
])
def test_each_preset_adapts_the_modules_it_claims(tmp_path: Path, model_type: str, values: dict[str, Any],
                                                   attention: str, mlp: str) -> None:
    """LoRA with each derived preset, applied by peft to the family's model: attn adapts the linear layers under the
    attention module, attn_mlp those and the MLP's, all_linear every linear layer but the output head."""
    from finetune.runtime import peft as lora  # imports torch

    row = derived(tmp_path, model_type, **values)
    config = transformers.AutoConfig.from_pretrained(tmp_path / model_type)
    every = linear_names(transformers.AutoModelForCausalLM.from_config(config))
    expected = {"attn": [n for n in every if attention in n],
                "attn_mlp": [n for n in every if attention in n or mlp in n],
                "all_linear": [n for n in every if n != "lm_head"]}
    assert expected["attn"] and set(expected["attn_mlp"]) > set(expected["attn"])
    for preset, names in expected.items():
        model = transformers.AutoModelForCausalLM.from_config(config)
        adapted = lora.apply(model, PeftConfig(method="lora", preset=preset), row)
        wrapped = sorted(name.removeprefix("base_model.model.").removesuffix(".lora_A")
                         for name, _ in adapted.named_modules() if name.endswith(".lora_A"))
        assert wrapped == sorted(names), preset


def test_a_router_is_no_mlp_projection_and_a_preset_that_finds_nothing_is_left_out() -> None:
    """lora_presets on a hand-built model: a linear layer with one output per expert (the config's num_experts)
    stays out of attn_mlp (all_linear keeps it); a layer without attention has no attn preset."""

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(8, 4)  # the router: one output per expert
            self.up_proj = torch.nn.Linear(8, 16)
            self.experts = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = Mlp()

    class Lm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.lm_head = torch.nn.Linear(8, 32)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

    presets = families.lora_presets(Lm(), {"Block"}, transformers.PretrainedConfig(num_experts=4))
    experts = tuple(f"experts.{i}" for i in range(4))  # the items of a list: a bare "0" would name layers.0 too
    assert presets == {"attn_mlp": ("mlp.up_proj", *experts), "all_linear": ("gate", "up_proj", *experts)}


@pytest.mark.parametrize(("model_type", "values", "why"), [
    ("roberta", {}, "a row is derived only for a causal language model"),  # RobertaForCausalLM: an encoder
    ("t5", {"d_model": 64, "num_layers": 2, "num_heads": 4, "d_ff": 128}, "only for a causal language model"),
    ("gemma3", {}, "only for a causal language model"),  # Gemma3ForConditionalGeneration
    ("mllama", {}, "its config nests other models' configs (text_config, vision_config"),
])
def test_a_model_that_is_no_plain_causal_lm_is_refused_in_one_line(tmp_path: Path, model_type: str,
                                                                    values: dict[str, Any], why: str) -> None:
    folder = tmp_path / model_type
    transformers.AutoConfig.for_model(model_type, **values).save_pretrained(folder)
    with pytest.raises(ConfigError) as info:
        families.resolve(ModelConfig(path=str(folder)))
    line = str(info.value)
    assert line.startswith(f"model.type: {model_type!r} (the model_type of model.path's config.json) has no row in "
                           "finetune's table, and ") and why in line and "\n" not in line
    assert line.endswith("(docs/architecture.md)") and "model.plugin" in line and not registry.DERIVED


def test_a_model_type_transformers_does_not_know_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my-own-lm", "auto_map": {}}))
    with pytest.raises(ConfigError, match=r"^model.type: 'my-own-lm' .* transformers does not know it"):
        families.resolve(ModelConfig(path=str(tmp_path)))


def test_a_recorded_derived_type_is_derived_again_and_a_typo_is_not(tmp_path: Path) -> None:
    """A resolved recipe of a derived row names its model type: another process derives the same row from the same
    folder. A type that is neither a row nor the folder's model_type is left for get_model's unknown-type line."""
    folder = config_folder(tmp_path / "neox", "gpt_neox", **TINY)
    model = ModelConfig(type="gpt_neox", path=str(folder))
    families.resolve(model)
    first = registry.DERIVED.pop("gpt_neox")
    families.resolve(model)
    assert registry.DERIVED["gpt_neox"] == first
    registry.DERIVED.clear()
    families.resolve(ModelConfig(type="gpt-neox", path=str(folder)))
    assert not registry.DERIVED
    with pytest.raises(ConfigError, match="unknown model type 'gpt-neox'"):
        registry.get_model("gpt-neox")


def test_the_untested_line_is_said_once_per_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process that reads the recipe derives the row; the command's first says it, and the processes it
    starts (which inherit its environment) and its later validations do not."""
    derived(tmp_path, "gpt_neox")
    derived(tmp_path / "again", "gpt_neox")
    assert capsys.readouterr().err.count("warning: model.type: gpt_neox") == 1
    monkeypatch.setenv(families.SAID_ENV, "falcon")
    derived(tmp_path, "falcon")
    assert capsys.readouterr().err == ""
