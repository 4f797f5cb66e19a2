"""Where a distillation teacher (``distill.teacher``) is read from, and what a folder must be to be one: torch-free,
so the CLI checks it before anything launches.

A teacher is a local Hugging Face model folder (config.json and ``.safetensors`` weights) or a finetune run whose
``final/`` is one. It is data only: a folder that holds code (``*.py``, or a config.json ``auto_map`` naming it) or
pickled weights (``.bin``, ``.pt``, ``.pth``, ``.pkl``, ``.ckpt``) is refused rather than loaded, since loading either
runs what is in it. The vocabulary check needs the tokenizers and is made when the run's inputs are read
(finetune.runtime.teacher), before the run folder is created.
"""

from __future__ import annotations

import json
from pathlib import Path

KEY = "distill.teacher"
PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")


def folder(path: str) -> Path:
    """The folder a teacher path names: the path, or its ``final/`` when it is a run directory."""
    given = Path(path).expanduser()
    return given / "final" if (given / "final" / "config.json").is_file() else given


def problems(path: str) -> list[str]:
    """Why ``path`` cannot be a teacher (empty: it can), one line each."""
    found = folder(path)
    if not found.is_dir():
        return [f"{KEY}: folder not found: {path} (give a model folder or a finetune run of the student's "
                "tokenizer)"]
    config = found / "config.json"
    if not config.is_file():
        adapter = " (it holds a LoRA adapter: merge it first with finetune merge)" if \
            (found / "adapter_config.json").is_file() else ""
        return [f"{KEY}: {path} has no config.json{adapter}; give a Hugging Face model folder or a run with final/"]
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return [f"{KEY}: {config} cannot be read ({str(exc).splitlines()[0] if str(exc) else exc!r})"]
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        return [f"{KEY}: {config} has no model_type; it is not a Hugging Face model config"]
    code = sorted(p.name for p in found.glob("*.py"))
    if code or data.get("auto_map"):
        what = ", ".join(code) if code else "auto_map in config.json"
        return [f"{KEY}: {found} holds model code ({what}); a teacher is loaded as data only: give a folder of a "
                "model transformers ships, without code"]
    pickled = sorted(p.name for pattern in PICKLES for p in found.glob(pattern))
    if pickled:
        return [f"{KEY}: {found} holds pickled weights ({pickled[0]}), which loading would run; convert them to "
                ".safetensors (a teacher is loaded from safetensors only)"]
    if not any(found.glob("*.safetensors")):
        return [f"{KEY}: {found} holds no .safetensors weights"]
    return []
