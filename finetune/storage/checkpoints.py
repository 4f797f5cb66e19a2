"""The checkpoint folder as files: its manifest, the fingerprints in it, verification, listing, pruning, and our
own state files (JSON with any tensors in safetensors).

A checkpoint is ``checkpoints/step-000400/``, renamed from ``step-000400.tmp/`` once every rank has written it
(finetune.artifacts.checkpoint writes it), so a folder without the ``.tmp`` suffix is always complete.
``manifest.json`` is written last: the run id, fingerprints of recipe, data, tokenizer and the files that define
the objective (:mod:`finetune.storage.objective`), the layout that wrote it, the batch layout and library versions,
and the size and sha256 of every file. :func:`verify` checks all of it before anything is loaded. Everything of
ours is JSON, with any tensors in safetensors (:func:`write_state`): nothing is unpickled.

Nothing here builds a model or runs a collective: ``finetune ls``, resume's choice of checkpoint and export's
checks read these files without a process group.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import __version__, registry
from finetune.config import RecipeConfig, to_yaml
from finetune.errors import RunDirError
from finetune.registry import SupportedModel
from finetune.storage import objective, rundir
from finetune.storage.record import record
from finetune.storage.state import TrainState


def file_fingerprint(path: str | None) -> str | None:
    """sha256 of a local file (None for no file; the name itself for a hub dataset)."""
    if not path:
        return None
    p = Path(path)
    return rundir.sha256_file(p) if p.is_file() else f"name:{path}"


def data_fingerprint(value: str | list[Any] | None) -> str | list[str | None] | None:
    """The fingerprint of ``data.train`` / ``data.eval``: :func:`file_fingerprint` of a path, and a list of them
    (one per source, in order) for a list of sources, so a change to any source file is seen."""
    if isinstance(value, list):
        return [file_fingerprint(source.path) for source in value]
    return file_fingerprint(value)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full serialized state (vocab, merges, special tokens, chat template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    text += str(getattr(tokenizer, "chat_template", "") or "")
    return hashlib.sha256(text.encode()).hexdigest()


def manifest(cfg: RecipeConfig, state: TrainState, layout: dict[str, Any], tokenizer_sha256: str, run_id: str,
             labels: list[str] | None = None, row: SupportedModel | None = None) -> dict[str, Any]:
    """What a later resume compares against, what ``finetune ls`` shows, and what a later export, eval or merge
    opens the checkpoint with (the row, the classification ``labels`` and the layout: :mod:`finetune.storage.
    record`); the inventory is added on write. ``layout``: the backend's layout record, of which the top-level
    ``backend`` and ``world_size`` are copies for readers of older manifests. ``tokenizer_sha256``:
    :func:`tokenizer_fingerprint` of the run's tokenizer."""
    import accelerate  # lazy: heavy
    import torch  # lazy: heavy
    import transformers  # lazy: heavy

    return {
        "kind": "checkpoint",
        "run_id": run_id,
        "step": state.step,
        "samples_seen": state.samples_seen,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "recipe_sha256": hashlib.sha256(to_yaml(cfg).encode()).hexdigest(),
        "data": {"train": data_fingerprint(cfg.data.train), "eval": data_fingerprint(cfg.data.eval)},
        "objective": objective.fingerprints(cfg),  # reward models, reward functions' files, the reference
        "tokenizer_sha256": tokenizer_sha256,
        "world_size": layout["world_size"],  # (also in "layout"; kept for readers of older manifests)
        "backend": layout["backend"],
        "layout": layout,
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "versions": {"finetune": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__},
        "resumable": True,
        "reason": None,
        **record(cfg, row or registry.recipe_row(cfg), labels),  # the trainer's row; resolved here for tests
    }


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


def inspect(path: Path) -> CheckpointInfo:
    """Read a checkpoint's manifest and check that every file it lists is there with its size (cheap; the content
    hashes are checked by :func:`verify` before a resume or an eval loads it)."""
    present = rundir.entries(path) if path.is_dir() else {}
    size = sum(e.stat(follow_symlinks=False).st_size for e in present.values() if e.is_file(follow_symlinks=False))
    try:
        data = rundir.read_manifest(path)
        step, samples = int(data["step"]), int(data["samples_seen"])
    except rundir.ManifestError as exc:
        return CheckpointInfo(path, None, None, False, exc.reason, size, None, None)
    except (KeyError, TypeError, ValueError):
        return CheckpointInfo(path, None, None, False, f"{rundir.MANIFEST} is corrupted (no step)", size, None, None)
    problems = rundir.inventory_problems(path, data, hashes=False, present=present)
    reason = None if data.get("resumable", False) else str(data.get("reason"))
    if problems:
        reason = "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else "")
    return CheckpointInfo(path, step, samples, reason is None, reason, size, str(data.get("created") or "") or None,
                          data)


def verify(path: Path, run_id: str | None, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check a checkpoint or export completely before anything in it is loaded: its manifest, the sha256 of every
    file, no file it does not list, and (``run_id``) that it belongs to this run. Returns the manifest. ``data``:
    the manifest when the caller has read it already (:mod:`finetune.storage.choose` reads it once per command)."""
    data = rundir.read_manifest(path) if data is None else data
    if run_id is not None and data.get("run_id") != run_id:
        raise RunDirError(f"{path} belongs to another run (run id {data.get('run_id')}, this run is {run_id}); "
                          "a run resumes only from its own checkpoints")
    problems = rundir.inventory_problems(path, data, hashes=True)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise RunDirError(f"{path} failed verification: {shown}; it was changed after finetune wrote it: use "
                          "another checkpoint (--from) or start over")
    return data


def latest_resumable(run_dir: Path, infos: list[CheckpointInfo] | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint that can be resumed from: the one rule for "newest" (resume and export choose
    it through :func:`finetune.storage.choose.choose`, which passes the ``infos`` it already read; pruning keeps
    it; a failed write names it)."""
    if infos is not None:
        return next((info for info in reversed(infos) if info.resumable), None)
    for path in reversed(rundir.checkpoint_dirs(run_dir)):
        info = inspect(path)
        if info.resumable:
            return info
    return None


def _split(value: Any, tensors: dict[str, Any], path: str) -> Any:
    """``value`` as JSON, with every tensor moved into ``tensors`` (by a key) and tuples, non-string dict keys and
    numpy arrays tagged so that :func:`_join` restores them exactly."""
    import numpy as np  # lazy: heavy
    import torch  # lazy: heavy

    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"__dict__": {k: _split(v, tensors, f"{path}.{k}") for k, v in value.items()}}
        return {"__items__": [[_split(k, tensors, path), _split(v, tensors, path)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_split(v, tensors, path) for v in value]}
    if isinstance(value, list):
        return [_split(v, tensors, path) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot store {type(value).__name__} at {path} in a checkpoint")


def _join(value: Any, tensors: dict[str, Any]) -> Any:
    """Inverse of :func:`_split`; only JSON types, tensors, tuples and numpy arrays can come out."""
    import numpy as np  # lazy: heavy

    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return np.asarray(value["__ndarray__"], dtype=np.dtype(str(value["dtype"])))
    if "__dict__" in value:
        return {k: _join(v, tensors) for k, v in value["__dict__"].items()}
    if "__items__" in value:
        return {_join(k, tensors): _join(v, tensors) for k, v in value["__items__"]}
    if "__tuple__" in value:
        return tuple(_join(v, tensors) for v in value["__tuple__"])
    if "__float__" in value:
        return float(value["__float__"])
    raise ValueError(f"unknown entry {sorted(value)[:3]}")


def write_state(folder: Path, name: str, state: Any) -> None:
    """``<name>.json`` (+ ``<name>.safetensors`` when the state holds tensors)."""
    from safetensors.torch import save_file  # lazy: heavy

    tensors: dict[str, Any] = {}
    text = json.dumps(_split(state, tensors, name))
    if tensors:
        save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(text, encoding="utf-8")


def read_state(folder: Path, name: str) -> Any:
    """What :func:`write_state` wrote."""
    from safetensors.torch import load_file  # lazy: heavy

    tensor_file = folder / f"{name}.safetensors"
    tensors = load_file(str(tensor_file)) if tensor_file.is_file() else {}
    return _join(json.loads((folder / f"{name}.json").read_text(encoding="utf-8")), tensors)


def prune(run_dir: Path, keep_last: int | None) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints; the newest resumable one always stays."""
    if keep_last is None:
        return
    checkpoints = rundir.checkpoint_dirs(run_dir)
    newest_resumable = latest_resumable(run_dir)
    for old in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        if newest_resumable is None or old != newest_resumable.path:
            rundir.remove_checkpoint(old)


