"""Checkpoints (atomic, with a manifest) and the final Hugging Face export.

A checkpoint is written by every rank into ``checkpoints/step-000400.tmp/`` (``accelerator.save_state`` is a
collective) and renamed to ``step-000400/`` by rank 0 once every rank has finished, so a directory without the
``.tmp`` suffix is always complete. Besides what accelerate saves (model, optimizer, registered objects such as
the scheduler, TrainState and grad scaler, RNG states of every rank) it holds ``train_state.json``, the resolved
recipe and ``manifest.json`` (fingerprints of recipe, data and tokenizer, batch layout, library versions).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from finetune.config import RESOLVED_NAME, RecipeConfig, to_yaml
from finetune.state import TrainState

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"


def step_dir(run_dir: Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step-000400``."""
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def file_fingerprint(path: str | None) -> str | None:
    """sha256 of a local file (None for no file; the name itself for a hub dataset)."""
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        return f"name:{path}"
    digest = hashlib.sha256()
    with p.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full serialized state (vocab, merges, special tokens, chat template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    text += str(getattr(tokenizer, "chat_template", "") or "")
    return hashlib.sha256(text.encode()).hexdigest()


def manifest(cfg: RecipeConfig, state: TrainState, world_size: int, tokenizer: Any) -> dict[str, Any]:
    """What a later resume compares against, and what ``finetune ls`` shows."""
    import accelerate
    import torch
    import transformers

    from finetune import __version__

    return {
        "step": state.step,
        "samples_seen": state.samples_seen,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "recipe_sha256": hashlib.sha256(to_yaml(cfg).encode()).hexdigest(),
        "data": {"train": file_fingerprint(cfg.data.train), "eval": file_fingerprint(cfg.data.eval)},
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "world_size": world_size,
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "versions": {"finetune": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__},
        "resumable": True,
        "reason": None,
    }


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (no ``.tmp``, manifest present), oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp") and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def save(accelerator: Any, cfg: RecipeConfig, state: TrainState, tokenizer: Any, run_dir: Path) -> Path:
    """Write a complete checkpoint of the current step on every rank; rank 0 publishes it atomically."""
    final = step_dir(run_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        for stale in (run_dir / CHECKPOINTS).glob("*.tmp") if (run_dir / CHECKPOINTS).is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)  # left by a crash: never complete, never resumed from
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    if accelerator.is_main_process:
        (tmp / TRAIN_STATE).write_text(json.dumps(asdict(state), indent=2))
        (tmp / RESOLVED_NAME).write_text(to_yaml(cfg))
        (tmp / MANIFEST).write_text(json.dumps(manifest(cfg, state, accelerator.num_processes, tokenizer), indent=2))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        prune(run_dir, cfg.checkpoint.keep_last)
    accelerator.wait_for_everyone()
    return final


def prune(run_dir: Path, keep_last: int | None) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (the newest resumable one always stays)."""
    if keep_last is None:
        return
    checkpoints = complete_checkpoints(run_dir)
    for old in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


def export_final(accelerator: Any, model: Any, tokenizer: Any, cfg: RecipeConfig, run_dir: Path) -> Path:
    """Write ``<run_dir>/final``: safetensors + config + tokenizer (+ label mapping in the config) + recipe."""
    out = run_dir / "final"
    tmp = run_dir / "final.tmp"
    state_dict = accelerator.get_state_dict(model)  # collective under sharded backends
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / RESOLVED_NAME).write_text(to_yaml(cfg))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    accelerator.wait_for_everyone()
    return out
