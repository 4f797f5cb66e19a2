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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune import hooks
from finetune.config import RESOLVED_NAME, RecipeConfig, to_yaml
from finetune.errors import RunDirError
from finetune.state import TrainState

if TYPE_CHECKING:
    from finetune.backends import Backend

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


def manifest(cfg: RecipeConfig, state: TrainState, world_size: int, tokenizer: Any, backend: str,
             files: dict[str, int]) -> dict[str, Any]:
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
        "backend": backend,
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "versions": {"finetune": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__},
        "resumable": True,
        "reason": None,
        "files": files,
    }


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (renamed from ``.tmp``), oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))


@dataclass
class CheckpointInfo:
    """What ``finetune ls`` shows and what resume checks."""

    path: Path
    step: int | None
    samples_seen: int | None
    resumable: bool
    reason: str | None
    size_bytes: int
    created: str | None
    manifest: dict[str, Any] | None


def _files(path: Path) -> dict[str, int]:
    """Every file under ``path`` with its size, by relative path (the manifest's inventory)."""
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}


def inspect(path: Path) -> CheckpointInfo:
    """Read a checkpoint's manifest and check that every file it lists is there with its size."""
    present = _files(path)
    size = sum(present.values())
    try:
        data = json.loads((path / MANIFEST).read_text())
        if not isinstance(data, dict) or not {"step", "samples_seen", "files"} <= data.keys():
            raise ValueError("missing step/samples_seen/files")
    except FileNotFoundError:
        return CheckpointInfo(path, None, None, False, "no manifest.json", size, None, None)
    except (ValueError, json.JSONDecodeError) as exc:
        return CheckpointInfo(path, None, None, False, f"manifest.json is corrupted ({exc})", size, None, None)
    missing = [name for name, bytes_ in data["files"].items() if present.get(name) != bytes_]
    reason = data.get("reason") if not data.get("resumable", False) else None
    if missing:
        reason = f"missing or truncated: {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "")
    return CheckpointInfo(path, int(data["step"]), int(data["samples_seen"]), reason is None, reason, size,
                          data.get("created"), data)


def latest_resumable(run_dir: Path) -> CheckpointInfo | None:
    """The newest complete checkpoint that can be resumed from."""
    for path in reversed(complete_checkpoints(run_dir)):
        info = inspect(path)
        if info.resumable:
            return info
    return None


def find(run_dir: Path, name: str | None) -> CheckpointInfo:
    """The checkpoint ``name`` (e.g. ``step-000100``) or the newest resumable one; RunDirError if none fits."""
    if name is None:
        info = latest_resumable(run_dir)
        if info is None:
            broken = [f"{p.name}: {inspect(p).reason}" for p in complete_checkpoints(run_dir)]
            detail = f" ({'; '.join(broken)})" if broken else ""
            raise RunDirError(f"{run_dir}: no complete resumable checkpoint to resume from{detail}; start the run "
                              f"again with `finetune run {run_dir / RESOLVED_NAME} --overwrite`")
        return info
    path = run_dir / CHECKPOINTS / name if not Path(name).is_dir() else Path(name)
    if not path.is_dir() or path.name.endswith(".tmp"):
        names = ", ".join(p.name for p in complete_checkpoints(run_dir)) or "none"
        raise RunDirError(f"--from {name}: no such complete checkpoint in {run_dir / CHECKPOINTS} (have: {names})")
    info = inspect(path)
    if not info.resumable:
        raise RunDirError(f"{path}: not resumable: {info.reason}")
    return info


def save(accelerator: Any, cfg: RecipeConfig, state: TrainState, tokenizer: Any, run_dir: Path,
         backend: str = "single") -> Path:
    """Write a complete checkpoint of the current step on every rank; rank 0 publishes it atomically."""
    final = step_dir(run_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        for stale in (run_dir / CHECKPOINTS).glob("*.tmp") if (run_dir / CHECKPOINTS).is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)  # left by a crash: never complete, never resumed from
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    hooks.fire("checkpoint_written", path=tmp)
    if accelerator.is_main_process:
        (tmp / TRAIN_STATE).write_text(json.dumps(asdict(state), indent=2))
        (tmp / RESOLVED_NAME).write_text(to_yaml(cfg))
        info = manifest(cfg, state, accelerator.num_processes, tokenizer, backend, _files(tmp))
        (tmp / MANIFEST).write_text(json.dumps(info, indent=2))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        prune(run_dir, cfg.checkpoint.keep_last)
    accelerator.wait_for_everyone()
    return final


def prune(run_dir: Path, keep_last: int | None) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints; the newest resumable one always stays."""
    if keep_last is None:
        return
    checkpoints = complete_checkpoints(run_dir)
    newest_resumable = latest_resumable(run_dir)
    for old in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        if newest_resumable is None or old != newest_resumable.path:
            shutil.rmtree(old, ignore_errors=True)


MERGE_CHECK = "merge_check.safetensors"


def export_final(accelerator: Any, model: Any, tokenizer: Any, cfg: RecipeConfig, run_dir: Path,
                 backend: Backend, probe: dict[str, Any] | None = None,
                 rebuild: Callable[[], Any] | None = None) -> Path:
    """Write ``<run_dir>/final`` in Hugging Face format: a full model (safetensors, config with the label mapping)
    or, for LoRA runs, a PEFT adapter plus ``merge_check.safetensors`` (the live model's logits on ``probe``, which
    ``finetune merge`` must reproduce); always the tokenizer and the resolved recipe.

    ``rebuild`` makes a clean (unwrapped) copy of the model on rank 0 to save from, for wrappers whose module names
    differ from the gathered state dict's (FSDP1: peft would find no adapter and save an empty one)."""
    import torch

    from finetune.backends import full_state_dict

    out = run_dir / "final"
    tmp = run_dir / "final.tmp"
    state_dict = full_state_dict(accelerator, model, backend)  # collective under sharded backends
    reference = None
    if cfg.peft.method != "none" and probe is not None:
        was_training = model.training
        model.eval()
        with torch.no_grad():  # every rank: a forward pass is a collective under sharded backends
            inputs = {k: v.to(accelerator.device) for k, v in probe.items()}
            reference = {**probe, "logits": model(**inputs).logits.float().cpu()}
        model.train(was_training)
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        shutil.rmtree(tmp, ignore_errors=True)
        saver = accelerator.unwrap_model(model)
        if rebuild is not None:
            saver = rebuild()
            saver.load_state_dict(state_dict)
        saver.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / RESOLVED_NAME).write_text(to_yaml(cfg))
        if reference is not None:
            save_file({k: v.contiguous() for k, v in reference.items()}, str(tmp / MERGE_CHECK))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    accelerator.wait_for_everyone()
    return out
