"""LoRA / DoRA / QLoRA: presets resolved through the SupportedModel row, checked, applied with ``peft``.

A preset names module *suffixes* from the row (``q_proj``, ``attn.c_proj``, ...); an explicit
``peft.target_modules`` list overrides it. A list that matches no linear module of the model is a config error
that lists the model's linear module names, instead of peft's silent or cryptic behaviour. ``peft`` takes ~5 s to
import, so this module imports it only inside functions.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

from finetune.backends import full_numel
from finetune.config.schema import PeftConfig
from finetune.errors import ConfigError
from finetune.quiet import library_warnings_off
from finetune.registry import CAUSAL_TASKS, SupportedModel, row_task

LINEAR_TYPES = ("Linear", "Conv1D", "Linear4bit", "Linear8bitLt")  # torch, GPT-2 Conv1D, bitsandbytes


def enabled(cfg: PeftConfig) -> bool:
    """Whether the recipe trains an adapter."""
    return cfg.method != "none"


def target_modules(cfg: PeftConfig, row: SupportedModel) -> list[str]:
    """The module-name suffixes to adapt: the explicit list, else the row's preset."""
    return list(cfg.target_modules) if cfg.target_modules else list(row.lora_targets[cfg.preset])


def modules_to_save(cfg: PeftConfig, row: SupportedModel) -> list[str] | None:
    """Modules trained in full next to the adapter: the recipe's list, else the row's head (the classification
    head; a reward model's new score head, see registry.for_task)."""
    if cfg.modules_to_save is not None:
        return list(cfg.modules_to_save) or None
    return list(row.head_modules) or None


def linear_module_names(model: Any) -> list[str]:
    """Names of the model's linear layers (what LoRA can adapt): of a class named in :data:`LINEAR_TYPES`, or a
    subclass of ``nn.Linear`` (Falcon's ``FalconLinear``), which peft adapts as a Linear."""
    import torch  # lazy: heavy

    return [name for name, module in model.named_modules()
            if type(module).__name__ in LINEAR_TYPES or isinstance(module, torch.nn.Linear)]


def matched_modules(model: Any, targets: list[str], exclude: str | None = None) -> list[str]:
    """Linear modules whose name is a target or ends with ``.target`` (peft's suffix rule), except those whose whole
    name matches the regular expression ``exclude`` (peft's ``exclude_modules`` rule for a string)."""

    return [name for name in linear_module_names(model)
            if any(name == t or name.endswith("." + t) for t in targets)
            and not (exclude and re.fullmatch(exclude, name))]


def check_targets(model: Any, cfg: PeftConfig, row: SupportedModel) -> list[str]:
    """The matched modules; a ConfigError listing the linear modules when a target matches nothing."""
    targets = target_modules(cfg, row)
    unmatched = [t for t in targets if not matched_modules(model, [t], row.lora_exclude)]
    if unmatched:
        names = sorted({name.rsplit(".", 1)[-1] for name in linear_module_names(model)})
        source = "peft.target_modules" if cfg.target_modules else f"peft.preset={cfg.preset}"
        raise ConfigError(f"{source}: {', '.join(unmatched)} match(es) no linear module of {row.name}; its linear "
                          f"modules are named {', '.join(names)}")
    return matched_modules(model, targets, row.lora_exclude)


def check_hardware(cfg: PeftConfig) -> None:
    """QLoRA needs bitsandbytes' 4-bit kernels: on a CUDA GPU, or its CPU backend (bitsandbytes >= 0.45, verified
    here with 0.50: 4-bit forward and LoRA training on CPU)."""
    if cfg.method != "qlora":
        return

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("peft.method=qlora needs bitsandbytes (pip install -e '.[qlora]'); or use peft.method=lora")


def quantization_config(cfg: PeftConfig) -> Any:
    """The 4-bit NF4 base-model quantization of QLoRA (None for other methods)."""
    if cfg.method != "qlora":
        return None
    import torch  # lazy: heavy
    import transformers  # lazy: heavy

    compute = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # CPUs here have no native bf16
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)


def apply(model: Any, cfg: PeftConfig, row: SupportedModel) -> Any:
    """Wrap ``model`` in a PeftModel; only adapter (and modules_to_save) parameters stay trainable."""
    import peft  # lazy: heavy

    check_targets(model, cfg, row)
    with library_warnings_off():  # peft calls transformers' deprecated aliases: not the user's (finetune/quiet.py)
        if cfg.method == "qlora":
            model = peft.prepare_model_for_kbit_training(model)
        return peft.get_peft_model(model, _lora_config(cfg, row))


def _lora_config(cfg: PeftConfig, row: SupportedModel) -> Any:
    """peft's LoraConfig for the recipe's method, targets and modules to save."""
    import peft  # lazy: heavy

    # Classification and reward models use peft's generic task type: SEQ_CLS would add "classifier"/"score" to
    # modules_to_save whatever the recipe says, so an explicit list (or [] for none) would not be honoured.
    return peft.LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=target_modules(cfg, row),
        modules_to_save=modules_to_save(cfg, row), use_dora=cfg.method == "dora",
        exclude_modules=row.lora_exclude,  # e.g. a vision tower whose linear layers share the decoder's names
        task_type="CAUSAL_LM" if row.task in CAUSAL_TASKS else None,
    )


def parameter_counts(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter elements, of whole tensors (:func:`finetune.backends.full_numel`): under
    ZeRO-3 a ``model.path`` model is partitioned at birth, and ``numel()`` counts this rank's empty placeholders."""
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    return trainable, sum(full_numel(p) for p in model.parameters())


def describe_on_meta(cfg: Any, row: SupportedModel) -> dict[str, Any]:
    """Resolved targets and parameter counts without loading weights: the model is built on the meta device."""
    import torch  # lazy: heavy

    from finetune.runtime.modeling import build_config  # lazy: imports torch

    config = build_config(cfg.model, row, labels=_label_names(cfg) if row_task(row).labels else None)
    import transformers  # lazy: heavy

    with torch.device("meta"):
        model = getattr(transformers, row.auto_class).from_config(config)
    matched = check_targets(model, cfg.peft, row)
    model = apply(model, cfg.peft, row)
    trainable, total = parameter_counts(model)
    return {"method": cfg.peft.method, "target_modules": target_modules(cfg.peft, row),
            "modules_to_save": modules_to_save(cfg.peft, row), "adapted_modules": len(matched),
            "trainable_params": trainable, "total_params": total,
            "trainable_percent": round(100.0 * trainable / max(total, 1), 4)}


def _label_names(cfg: Any) -> list[str]:
    """The classification labels the run will use (the head's size counts as trainable parameters): the recipe's
    ``data.labels``, else the names in the train file; two placeholders when the file cannot be read here."""
    if cfg.data.labels:
        return list(cfg.data.labels)
    try:
        from finetune.data.loading import load_raw  # imports numpy (the data package): not at CLI start-up
        from finetune.data.tokenize import label_names  # imports numpy

        return label_names(load_raw(cfg.data.train), None, cfg.data.train)
    except Exception:  # e.g. a hub dataset offline: the counts are then approximate
        return ["a", "b"]


def register_adapter_checkpointing(accelerator: Any) -> None:
    """Checkpoints of LoRA runs hold the adapter (and modules_to_save), not the frozen base.

    accelerate's save/load hooks apply where it saves a plain state dict (one process, DDP); sharded backends keep
    their own (sharded, complete) format.
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict  # lazy: heavy
    from safetensors.torch import load_file  # lazy: heavy

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        for i, model in enumerate(models):
            if i < len(weights):
                weights[i] = get_peft_model_state_dict(accelerator.unwrap_model(model))

    def load_hook(models: list[Any], input_dir: str) -> None:

        path = os.path.join(input_dir, "model.safetensors")
        if models and os.path.isfile(path):
            set_peft_model_state_dict(accelerator.unwrap_model(models[0]), load_file(path))
            models.pop(0)  # loaded here: accelerate must not load it again (it is adapter-only)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
