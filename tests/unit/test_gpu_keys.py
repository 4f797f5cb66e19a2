"""GPU-readiness recipe keys on a CPU machine: model.attn_implementation, train.compile, optim.fused.

Each key must either work on CPU or fail in one line that names it: the schema (values), the validator
(flash_attention_2 without flash_attn or half precision), the model build (no CUDA, a model class that refuses an
implementation), the optimizer (fused kernels), and torch.compile's lazy failures.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers
from pydantic import ValidationError

from finetune import registry
from finetune.config import load_recipe
from finetune.config.schema import ModelConfig, OptimConfig, TrainConfig
from finetune.errors import ConfigError
from finetune.runtime.modeling import build_model, compile_failures, compile_model
from finetune.runtime.optim import build_optimizer, fused_adamw_available, use_fused
from tests.cli_helpers import assert_user_error, main_exit

ROW = registry.get_model("tiny-llama")
REAL_FIND_SPEC = importlib.util.find_spec


pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def flash_attn_installed(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    """Make ``importlib.util.find_spec("flash_attn")`` answer ``installed`` (the validator's look-up), whatever
    this machine has; every other module is looked up for real."""
    spec = REAL_FIND_SPEC("json")

    def find_spec(name: str, *args: object, **kwargs: object) -> object:
        if name == "flash_attn":
            return spec if installed else None
        return REAL_FIND_SPEC(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def errors_of(recipe: Path, overrides: list[str]) -> list[str]:
    """The lines of the ConfigError that composing + validating ``recipe`` with ``overrides`` raises."""
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, overrides)
    return str(info.value).splitlines()


# --- schema -----------------------------------------------------------------------------------------------------


def test_defaults_keep_todays_behaviour() -> None:
    assert ModelConfig(type="tiny-llama").attn_implementation is None
    assert TrainConfig(max_steps=1).compile is False
    assert OptimConfig().fused is None


@pytest.mark.parametrize("overrides,check", [
    (["model.attn_implementation=sdpa"], lambda cfg: cfg.model.attn_implementation == "sdpa"),
    (["model.attn_implementation=eager"], lambda cfg: cfg.model.attn_implementation == "eager"),
    (["model.attn_implementation=null"], lambda cfg: cfg.model.attn_implementation is None),
    (["train.compile=true"], lambda cfg: cfg.train.compile is True),
    (["optim.fused=true"], lambda cfg: cfg.optim.fused is True),
    (["optim.fused=false"], lambda cfg: cfg.optim.fused is False),
    (["optim.name=sgd", "optim.fused=false"], lambda cfg: cfg.optim.fused is False),
], ids=["sdpa", "eager", "attn-null", "compile", "fused", "not-fused", "sgd-not-fused"])
def test_schema_accepts(write_recipe, overrides, check) -> None:
    cfg, _ = load_recipe(write_recipe(), overrides)
    assert check(cfg)


@pytest.mark.parametrize("override,needle", [
    ("model.attn_implementation=flash", "model.attn_implementation: "),
    ("model.attn_implementation=flash_attention_3", "model.attn_implementation: "),
    ("train.compile=maybe", "train.compile: "),
    ("optim.fused=sometimes", "optim.fused: "),
], ids=["attn-typo", "attn-fa3", "compile", "fused"])
def test_schema_refuses_bad_values_in_one_line_naming_the_key(write_recipe, override, needle) -> None:
    lines = errors_of(write_recipe(), [override])
    assert len(lines) == 1 and lines[0].startswith(needle), lines
    assert lines[0].endswith(f"(set at override {override})"), lines


def test_fused_is_refused_for_sgd(write_recipe) -> None:
    lines = errors_of(write_recipe(), ["optim.name=sgd", "optim.fused=true"])
    assert lines == ["optim.fused: true needs optim.name=adamw (the fused kernel used here is AdamW's), got sgd; set "
                     "optim.fused to null or false (set at override optim.fused=true)"]
    with pytest.raises(ValidationError):
        OptimConfig(name="sgd", fused=True)


# --- flash_attention_2 at validation time ----------------------------------------------------------------------


def test_flash_attention_without_flash_attn_is_one_line(write_recipe, monkeypatch) -> None:
    flash_attn_installed(monkeypatch, False)
    lines = errors_of(write_recipe(), ["model.attn_implementation=flash_attention_2",
                                       "train.mixed_precision=bf16"])
    assert lines == ["model.attn_implementation: flash_attention_2 needs the flash_attn package, which is not "
                     "installed; pip install flash-attn on a CUDA machine, or use model.attn_implementation=sdpa"]


def test_flash_attention_without_flash_attn_through_finetune_config(write_recipe, monkeypatch, capsys) -> None:
    flash_attn_installed(monkeypatch, False)
    code, out, err = main_exit(monkeypatch, capsys, "config", str(write_recipe()),
                               "model.attn_implementation=flash_attention_2", "model.dtype=bfloat16")
    lines = assert_user_error(code, out, err, "model.attn_implementation", "pip install flash-attn", "sdpa")
    assert len(lines) == 1, lines


def test_flash_attention_in_fp32_without_autocast_is_one_line(write_recipe, monkeypatch) -> None:
    flash_attn_installed(monkeypatch, True)
    lines = errors_of(write_recipe(), ["model.attn_implementation=flash_attention_2"])
    assert len(lines) == 1 and lines[0].startswith("model.attn_implementation: flash_attention_2 runs in fp16/bf16"), \
        lines
    assert "train.mixed_precision=bf16" in lines[0]


@pytest.mark.parametrize("overrides", [["model.dtype=bfloat16"], ["model.dtype=float16"],
                                       ["train.mixed_precision=bf16"], ["train.mixed_precision=fp16"]])
def test_flash_attention_validates_with_half_precision_and_flash_attn(write_recipe, monkeypatch, overrides) -> None:
    flash_attn_installed(monkeypatch, True)
    cfg, _ = load_recipe(write_recipe(), ["model.attn_implementation=flash_attention_2", *overrides])
    assert cfg.model.attn_implementation == "flash_attention_2"


# --- attention at build time -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny-llama (config + weights): the from_pretrained path."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_model(ModelConfig(type="tiny-llama"), ROW).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("pretrained", [False, True], ids=["from_config", "from_pretrained"])
def test_model_is_built_with_the_chosen_attention(impl: str, pretrained: bool, tiny_folder: Path) -> None:
    cfg = ModelConfig(type="tiny-llama", path=str(tiny_folder) if pretrained else None, attn_implementation=impl)
    assert build_model(cfg, ROW).config._attn_implementation == impl


def test_null_attention_keeps_the_models_default() -> None:
    default = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**ROW.tiny_config)).config._attn_implementation
    assert build_model(ModelConfig(type="tiny-llama"), ROW).config._attn_implementation == default


def test_flash_attention_without_cuda_is_one_line_at_build(monkeypatch) -> None:
    monkeypatch.setattr("finetune.runtime.modeling.flash_attn_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        build_model(ModelConfig(type="tiny-llama", dtype="bfloat16", attn_implementation="flash_attention_2"), ROW)
    assert str(info.value).splitlines() == [
        "model.attn_implementation: flash_attention_2 needs a CUDA device and none is available here; use "
        "model.attn_implementation=sdpa (or null) on this machine"]


def test_flash_attention_without_flash_attn_is_one_line_at_build(monkeypatch) -> None:
    monkeypatch.setattr("finetune.runtime.modeling.flash_attn_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"^model\.attn_implementation: .*pip install flash-attn") as info:
        build_model(ModelConfig(type="tiny-llama", dtype="bfloat16", attn_implementation="flash_attention_2"), ROW)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("pretrained", [False, True], ids=["from_config", "from_pretrained"])
def test_a_model_class_that_refuses_the_implementation_is_one_line(pretrained: bool, tiny_folder: Path,
                                                                   monkeypatch) -> None:
    monkeypatch.setattr(transformers.LlamaForCausalLM, "_supports_sdpa", False)  # as a model without sdpa says
    cfg = ModelConfig(type="tiny-llama", path=str(tiny_folder) if pretrained else None, attn_implementation="sdpa")
    with pytest.raises(ConfigError) as info:
        build_model(cfg, ROW)
    lines = str(info.value).splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("model.attn_implementation: tiny-llama cannot use sdpa (LlamaForCausalLM does not "
                               "support"), lines
    assert lines[0].endswith("choose another model.attn_implementation or null (the model's default)"), lines


# --- optim.fused -----------------------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("device_type", [None, "cpu"], ids=["device-of-params", "cpu"])
def test_default_is_fused_where_torch_has_the_kernel(device_type: str | None) -> None:
    """null: torch's fused AdamW wherever this torch has the kernel (the CPU too: the Trainer's default, and 4x
    faster than the plain loop over parameters), with the same groups and hyperparameters as the plain AdamW."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    model = _model()
    opt = build_optimizer(cfg, model, device_type)
    plain = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                               {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                              lr=1e-2, betas=cfg.betas, eps=cfg.eps)
    fused = fused_adamw_available("cpu")
    assert all(group["fused"] is fused for group in opt.param_groups)
    assert [{k: v for k, v in g.items() if k not in ("params", "fused")} for g in opt.param_groups] == \
        [{k: v for k, v in g.items() if k not in ("params", "fused")} for g in plain.param_groups]


def test_fused_false_is_never_fused() -> None:
    opt = build_optimizer(OptimConfig(fused=False), _model(), "cpu")
    assert all(not group["fused"] for group in opt.param_groups)


def test_null_is_fused_exactly_where_the_kernel_is() -> None:
    assert use_fused(None, "cpu") is fused_adamw_available("cpu")
    assert use_fused(None, "cuda") is torch.cuda.is_available()
    assert use_fused(None, "meta") is False  # no kernel: the plain AdamW, no error


def _one_step(fused: bool | None) -> list[torch.Tensor]:
    model = _model()
    opt = build_optimizer(OptimConfig(lr=1e-2, weight_decay=0.1, fused=fused), model, "cpu")
    torch.manual_seed(1)
    model(torch.randn(16, 4)).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fused_true_on_cpu_works_and_matches_the_plain_step() -> None:
    if not fused_adamw_available("cpu"):  # an older torch: true must then be a one-line error
        with pytest.raises(ConfigError, match=r"^optim\.fused=true: torch .* has no fused AdamW kernel for device "
                                              r"'cpu'; set optim\.fused"):
            build_optimizer(OptimConfig(fused=True), _model(), "cpu")
        return
    opt = build_optimizer(OptimConfig(fused=True), _model(), "cpu")
    assert all(group["fused"] for group in opt.param_groups)
    for fused, plain in zip(_one_step(True), _one_step(None), strict=True):
        torch.testing.assert_close(fused, plain, rtol=0, atol=1e-6)


def test_fused_true_on_a_device_without_the_kernel_is_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        build_optimizer(OptimConfig(fused=True), _model(), "meta")  # torch has no fused AdamW for "meta"
    assert str(info.value).splitlines() == [
        f"optim.fused=true: torch {torch.__version__} has no fused AdamW kernel for device 'meta'; set optim.fused "
        "to null (fused where available) or false"]


# --- train.compile -------------------------------------------------------------------------------------------


def test_compile_is_in_place_and_keeps_parameter_names() -> None:
    model = build_model(ModelConfig(type="tiny-llama"), ROW)
    names = list(model.state_dict())
    assert compile_model(model, ROW) == 2  # each decoder layer, in place
    assert type(model) is transformers.LlamaForCausalLM and model._compiled_call_impl is None
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert list(model.state_dict()) == names


def test_a_failed_compile_becomes_one_line_naming_the_key() -> None:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    def backend() -> None:
        """Stands for inductor."""

    inner = InductorError(RuntimeError("Compiler: cc is not found\nmore detail"), None)
    with pytest.raises(ConfigError) as info, compile_failures(True):
        raise BackendCompilerFailed(backend, inner, None)
    assert str(info.value).splitlines() == [
        "train.compile: torch.compile failed (RuntimeError: Compiler: cc is not found); set train.compile=false to "
        "train without it"]


def test_without_compile_errors_pass_through() -> None:
    from torch._dynamo.exc import TorchRuntimeError

    with pytest.raises(TorchRuntimeError), compile_failures(False):
        raise TorchRuntimeError("not ours to translate")
    with pytest.raises(ValueError), compile_failures(True):  # not a compile failure: left alone
        raise ValueError("a bug elsewhere")


def test_kernel_keys_are_layout_changes_on_resume() -> None:
    """Switching a kernel on resume (a run moved to a GPU machine) is logged, not refused; a math key is refused."""
    from finetune.storage.resume import recipe_changes

    before = {"model": {"attn_implementation": None}, "train": {"compile": False}, "optim": {"fused": None, "lr": 1e-3}}
    after = {"model": {"attn_implementation": "flash_attention_2"}, "train": {"compile": True},
             "optim": {"fused": True, "lr": 1e-3}}
    changes, layout = recipe_changes(before, after)
    assert changes == [] and len(layout) == 3
    changes, _ = recipe_changes(before, {**after, "optim": {"fused": True, "lr": 2e-3}})
    assert changes == ["optim.lr: 0.001 -> 0.002"]
