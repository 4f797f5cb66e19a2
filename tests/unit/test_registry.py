"""The SupportedModel table: every row is well-formed data and builds a working model of its family; a user's plugin
module and factory run as guests (an exit they ask for is one line naming them, a real Ctrl+C stays one)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import transformers

from finetune import registry
from finetune.errors import ConfigError
from finetune.registry import SUPPORTED_MODELS

ROWS = sorted(SUPPORTED_MODELS)


def test_required_rows_exist() -> None:
    assert {"llama", "qwen2", "mistral", "gpt2", "bert", "tiny-llama"} <= set(SUPPORTED_MODELS)


@pytest.mark.parametrize("name", ROWS)
def test_row_is_consistent_data(name: str) -> None:
    row = SUPPORTED_MODELS[name]
    assert row.name == name
    assert row.task in registry.TASK_METRICS
    assert row.capabilities <= registry.CAPABILITIES
    assert hasattr(transformers, row.auto_class) and hasattr(transformers, row.config_class)
    assert set(row.lora_targets) == {"attn", "attn_mlp", "all_linear"}
    assert all(row.lora_targets.values())
    if row.debug_build:
        assert row.tokenizer is not None


@pytest.mark.parametrize("name", ROWS)
def test_row_builds_a_tiny_model_and_runs_a_forward(name: str) -> None:
    """Build the family from its tiny config; the decoder-layer class FSDP wraps and the LoRA targets exist."""
    row = SUPPORTED_MODELS[name]
    config = getattr(transformers, row.config_class)(**row.tiny_config)
    if row.task == "classification":
        config.num_labels = 3
    torch.manual_seed(0)
    model = getattr(transformers, row.auto_class).from_config(config)
    layer_classes = {type(m).__name__ for m in model.modules()}
    assert set(row.wrap_classes) <= layer_classes  # the decoder layer and any extra FSDP units (vision blocks)
    params = [n for n, _ in model.named_parameters()]
    for part, prefixes in row.freeze_groups.items():  # model.freeze: every part names some parameters
        assert any(n.startswith(x + ".") for n in params for x in prefixes), part
    if row.freeze_groups:  # and together they cover the whole model (freezing all parts leaves nothing to train)
        assert all(any(n.startswith(x + ".") for x in sum(row.freeze_groups.values(), ())) for n in params)
    module_names = [n for n, _ in model.named_modules()]
    for preset, targets in row.lora_targets.items():
        for target in targets:
            assert any(n == target or n.endswith("." + target) for n in module_names), (preset, target)
    for head in row.head_modules:
        assert any(n.endswith(head) for n in module_names)
    ids = torch.randint(0, 500, (2, 9))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    expected = (2, 3) if row.task == "classification" else (2, 9, config.get_text_config().vocab_size)
    assert tuple(out.logits.shape) == expected
    assert torch.isfinite(out.logits).all()


def test_unknown_model_type_lists_close_matches() -> None:
    with pytest.raises(ConfigError, match=r"unknown model type 'lama'; did you mean llama"):
        registry.get_model("lama")


@pytest.mark.parametrize("base,capability,message", [
    ("llama", "flying", "unknown capabilities"),
    ("bert", "packing", "packing is a causal_lm capability"),  # a classifier has no next-token targets to pack
])
def test_register_rejects_bad_capabilities(base: str, capability: str, message: str) -> None:
    row = SUPPORTED_MODELS[base]
    bad = registry.SupportedModel(**{**row.__dict__, "name": "bad", "capabilities": frozenset({capability})})
    with pytest.raises(ConfigError, match=message):
        registry.register(bad)
    assert "bad" not in SUPPORTED_MODELS


_CUSTOM = {"name": "custom", "task": "causal_lm", "decoder_layer": "Block", "tiny_config": {},
           "factory": "mypkg.models:build", "tokenizer": "tiny-llama-tokenizer"}


@pytest.mark.parametrize("fields,message", [
    ({"factory": "mypkg.models.build"}, "factory must be 'package.module:function'"),
    ({"auto_class": "AutoModelForCausalLM"}, "remove auto_class and config_class"),
    ({"task": "classification"}, "a factory row must be a causal_lm model"),
    ({"tokenizer": None}, "set tokenizer"),
    ({"model_inputs": ("input_ids", "labels", "attention_mask")}, "model_inputs ['labels'] are not batch keys"),
    ({"model_inputs": ("input_ids",)}, "must include input_ids and attention_mask"),
    ({"capabilities": frozenset({"packing"}), "model_inputs": ("input_ids", "attention_mask")},
     "add position_ids to model_inputs"),
    ({"factory": None}, "set auto_class and config_class"),
    ({"logit_softcap": "final_logit_softcapping"}, "logit_softcap shapes the logits of a Hugging Face model's "
                                                   "output_head"),
])
def test_register_rejects_a_malformed_custom_row(fields: dict, message: str) -> None:
    """A custom (factory) row is checked when registered: how it builds, its tokenizer and its forward's inputs."""
    bad = registry.SupportedModel(**{**_CUSTOM, **fields})
    with pytest.raises(ConfigError, match=re.escape(message)):
        registry.register(bad)
    assert "custom" not in SUPPORTED_MODELS


def test_register_checks_what_a_row_says_of_its_heads_logits() -> None:
    """logit_divisor / logit_softcap are config attribute names, for a row with an output head."""
    import dataclasses

    granite = SUPPORTED_MODELS["granite"]
    for fields, message in (({"logit_divisor": 8.0}, "logit_divisor names a config attribute"),
                            ({"logit_softcap": "final logit"}, "logit_softcap names a config attribute"),
                            ({"output_head": None}, "logit_divisor shapes the logits of a Hugging Face model's "
                                                    "output_head; set output_head or remove it")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            registry.register(dataclasses.replace(granite, name="my-granite", **fields))
    assert "my-granite" not in SUPPORTED_MODELS


def test_a_well_formed_custom_row_registers_without_importing_its_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    """register() only checks the factory's form: the module is imported when a model is built or validated (a
    missing one is then one ConfigError line naming model.plugin and the row)."""
    monkeypatch.setattr(registry, "SUPPORTED_MODELS", dict(SUPPORTED_MODELS))
    registry.register(registry.SupportedModel(**_CUSTOM, model_inputs=("input_ids", "attention_mask")))
    row = registry.get_model("custom")
    assert row.factory == "mypkg.models:build" and row.auto_class == ""
    with pytest.raises(ConfigError, match=r"model.plugin: SupportedModel 'custom' factory 'mypkg.models:build': "
                                          r"cannot import 'mypkg.models'"):
        registry.resolve_factory(row)
    with pytest.raises(ConfigError, match="task: reward needs a Hugging Face sequence-classification class"):
        registry.for_task(row, "reward")


@pytest.mark.parametrize("fields,message", [
    ({"image_token": None}, "a vision_causal_lm row sets image_token"),
    ({"task": "causal_lm", "model_inputs": registry.MODEL_INPUTS}, "image_token is for vision_causal_lm rows"),
    ({"freeze_groups": {"vision": ()}}, "freeze_groups['vision'] must be a non-empty tuple"),
    ({"freeze_groups": {"vision": "model.visual"}}, "freeze_groups['vision'] must be a non-empty tuple"),
    ({"lora_exclude": "(unclosed"}, "lora_exclude is not a regular expression"),
    ({"model_inputs": ("input_ids", "attention_mask", "pixel_mask")}, "model_inputs ['pixel_mask'] are not batch"),
])
def test_register_rejects_a_malformed_vision_row(fields: dict, message: str) -> None:
    """A vision-language row is checked when registered: its image token, freeze parts, LoRA exclusion, inputs."""
    import dataclasses

    bad = dataclasses.replace(SUPPORTED_MODELS["qwen2_vl"], name="my-vlm", **fields)
    with pytest.raises(ConfigError, match=re.escape(message)):
        registry.register(bad)
    assert "my-vlm" not in SUPPORTED_MODELS


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """``write(source)``: a module ``user_plugin_under_test`` holding ``source``, importable (and not yet imported)
    for this test only; returns its name."""
    name = "user_plugin_under_test"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)

    def write(source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        return name

    yield write
    sys.modules.pop(name, None)


def _factory_row(module: str) -> registry.SupportedModel:
    return registry.SupportedModel(**{**_CUSTOM, "factory": f"{module}:build"})


@pytest.mark.parametrize(("source", "call", "where"), [
    ("import sys\nsys.exit(0)\n", registry.load_plugin, "model.plugin: importing '{module}'"),
    ("raise SystemExit('done')\n", lambda module: registry.resolve_factory(_factory_row(module)),
     "model.plugin: SupportedModel 'custom' factory '{module}:build': importing '{module}'"),
    ("import sys\n\ndef build(config, dtype):\n    sys.exit(0)\n",
     lambda module: registry.resolve_factory(_factory_row(module))({}, None),
     "model.plugin: SupportedModel 'custom' factory '{module}:build'"),
])
def test_an_exit_a_plugin_asks_for_is_one_line_naming_it(user_module: Callable[[str], str], source: str,
                                                         call: Callable[[str], object], where: str) -> None:
    """sys.exit in a model.plugin module or its factory, even exit 0, is a ConfigError (exit 2), not the end of
    finetune's process."""
    module = user_module(source)
    with pytest.raises(ConfigError) as info:
        call(module)
    message = str(info.value)
    assert message.startswith(where.format(module=module) + ": called sys.exit(") and "\n" not in message


def test_a_keyboard_interrupt_is_a_ctrl_c_only_when_one_was_pressed(user_module: Callable[[str], str]) -> None:
    """A KeyboardInterrupt the plugin raises itself is its failure; a Ctrl+C pressed while the plugin runs (here the
    second SIGINT during training, which finetune's handler turns into an abort) stops finetune as a Ctrl+C."""
    from finetune.errors import Aborted
    from finetune.runtime.signals import StopRequest

    module = user_module("raise KeyboardInterrupt\n")
    with pytest.raises(ConfigError, match=rf"^model.plugin: importing '{module}': raised KeyboardInterrupt itself"):
        registry.load_plugin(module)
    sys.modules.pop(module, None)
    user_module("import os, signal\n\nfor _ in range(2):\n    os.kill(os.getpid(), signal.SIGINT)\n")
    with StopRequest().installed(), pytest.raises(Aborted):
        registry.load_plugin(module)
