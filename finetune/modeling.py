"""Build the model and tokenizer a recipe names, through its SupportedModel row.

``model.path`` may be a hub id, a local folder, or ``pkg://<module>[/sub/path]``: a Python package that ships
weights (its ``get_model_path()`` when it has one, else its folder). A ``debug_build`` row with a null path
builds its tiny config and the tokenizer bundled in ``finetune/assets`` (no download).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import torch
import transformers

from finetune.config.schema import ModelConfig
from finetune.errors import ConfigError
from finetune.registry import SupportedModel

ASSETS = Path(__file__).resolve().parent / "assets"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(path: str) -> str:
    """Turn ``pkg://module[/sub]`` into a folder; other values pass through (hub id or local folder)."""
    if not path.startswith("pkg://"):
        return path
    module_name, _, sub = path.removeprefix("pkg://").partition("/")
    if importlib.util.find_spec(module_name) is None:
        raise ConfigError(f"model.path: package {module_name!r} is not installed")
    module = importlib.import_module(module_name)
    root = Path(module.get_model_path()) if hasattr(module, "get_model_path") and not sub else \
        Path(module.__file__).parent  # type: ignore[arg-type]
    return str(root / sub) if sub else str(root)


def build_tokenizer(cfg: ModelConfig, row: SupportedModel, source: str | None = None) -> Any:
    """The tokenizer of ``source`` (an exported model), else the model's, else the row's bundled one."""
    where = source or (resolve_model_path(cfg.path) if cfg.path else str(ASSETS / (row.tokenizer or "")))
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # decoders without a pad token: padding is masked anyway
    return tokenizer


def build_config(cfg: ModelConfig, row: SupportedModel, source: str | None = None,
                 labels: list[str] | None = None) -> Any:
    """The HF config: from ``source``/``model.path`` or the row's tiny config, plus ``model.config_overrides``."""
    if source or cfg.path:
        config = transformers.AutoConfig.from_pretrained(source or resolve_model_path(cfg.path or ""),
                                                         trust_remote_code=cfg.trust_remote_code)
    else:
        config = getattr(transformers, row.config_class)(**row.tiny_config)
    for key, value in cfg.config_overrides.items():
        setattr(config, key, value)
    if labels is not None:
        config.num_labels = len(labels)
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
    return config


def build_model(cfg: ModelConfig, row: SupportedModel, *, source: str | None = None,
                labels: list[str] | None = None, quantization: Any = None) -> Any:
    """Instantiate the row's auto class: pretrained weights from ``source``/``model.path``, else from config.

    ``quantization`` (QLoRA's 4-bit config) needs pretrained weights."""
    auto = getattr(transformers, row.auto_class)
    config = build_config(cfg, row, source, labels)
    dtype = DTYPES[cfg.dtype]
    if source or cfg.path:
        where = source or resolve_model_path(cfg.path or "")
        extra: dict[str, Any] = {}
        if quantization is not None:  # 4-bit weights are placed at load time and cannot be moved afterwards
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            extra = {"quantization_config": quantization, "device_map": {"": device}}
        model = auto.from_pretrained(where, config=config, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                                     **extra)
    else:
        if quantization is not None:
            raise ConfigError("peft.method=qlora quantizes pretrained weights; set model.path")
        model = auto.from_config(config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    return model


def build_base(cfg: ModelConfig, row: SupportedModel, seed: int, labels: list[str] | None = None,
               quantization: Any = None) -> Any:
    """The model a run starts from: seeded first, so a config-built (debug) model is the same one every time -
    in training, in ``finetune eval`` of an adapter and in ``finetune merge``."""
    from accelerate.utils import set_seed

    set_seed(seed)
    return build_model(cfg, row, labels=labels, quantization=quantization)
