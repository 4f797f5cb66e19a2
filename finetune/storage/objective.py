"""Fingerprints of what defines a run's objective besides its recipe: the files its loss reads again on resume.

A resume reloads these from their paths, so a change between the checkpoint and the resume would change what the
run optimises without any recipe key changing: a reward model's weights, a reward function's source file, the
reference model of DPO and GRPO (the initial weights, ``model.path``; a LoRA run's base, which the adapter trains
on). The recipe itself (regex, weights, names, beta, ...) is compared key by key by
:mod:`finetune.storage.resume`; data files by their own fingerprints.

:data:`PARTS` is the table: each row says which recipe keys name such a file (``keys``), how to fingerprint what
one names (``fingerprint``) and how a resume line describes it (``what``). A new kind (a teacher model) is one
row. The checkpoint manifest stores ``{key: fingerprint}`` (:func:`fingerprints`), and a resume lists each key
whose fingerprint differs (:func:`changes`).

Storage only: files are hashed as bytes, streamed (never loaded, never imported, so a function's module runs no code
here); each file is hashed once per process while its size and modification time stay the same (a checkpoint
of a run whose reference is a 7B model does not hash its 14 GB again at every save).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import objectives
from finetune.storage import rundir

MODEL_FILES = ("config.json", "*.safetensors", "*.bin")  # a model folder's config and weights (either format)
REWARD_MODEL_FILES = ("config.json", "*.safetensors", "final/config.json", "final/*.safetensors")  # or its run's


@dataclass(frozen=True)
class Part:
    """One row of :data:`PARTS`: ``keys(cfg)`` yields (recipe key, the value it names) for each file of this kind
    the recipe's objective reads; ``fingerprint(value)`` is that file's fingerprint now (None: nothing there);
    ``what(value)`` names it in a resume line."""

    keys: Callable[[Any], Iterator[tuple[str, str]]]
    fingerprint: Callable[[str], str | None]
    what: Callable[[str], str]


def _rewards(kind: str) -> Callable[[Any], Iterator[tuple[str, str]]]:
    """The ``grpo.rewards[i].<kind>`` values of a recipe whose task is scored by them (its record's ``rewards``)."""

    def keys(cfg: Any) -> Iterator[tuple[str, str]]:
        record = objectives.objective(cfg.task)
        if record is not None and record.rewards:
            for i, spec in enumerate(cfg.grpo.rewards):
                if getattr(spec, kind) is not None:
                    yield f"grpo.rewards[{i}].{kind}", getattr(spec, kind)

    return keys


def _reference(cfg: Any) -> Iterator[tuple[str, str]]:
    """``model.path`` when a resume reloads it as part of the objective: the reference (the initial weights) of a
    task that compares with it (:func:`finetune.objectives.needs_reference`: DPO, GRPO with a KL term), and the
    base under a LoRA-family adapter (the frozen weights the adapter adds to, and the reference with the adapter
    disabled)."""
    if cfg.model.path and (objectives.needs_reference(cfg.task, cfg) or cfg.peft.method != "none"):
        yield "model.path", cfg.model.path


def _teacher(cfg: Any) -> Iterator[tuple[str, str]]:
    """``distill.teacher`` of a task that learns from a teacher (its record's ``teacher``): the distributions it
    learns, so a resume with other teacher weights is refused as a changed objective."""
    record = objectives.objective(cfg.task)
    if record is not None and record.teacher and cfg.distill.teacher:
        yield "distill.teacher", cfg.distill.teacher


PARTS: tuple[Part, ...] = (
    Part(_rewards("reward_model"), lambda path: folder_fingerprint(path, REWARD_MODEL_FILES),
         lambda path: f"the weights of {path}"),
    Part(_rewards("function"), lambda target: source_fingerprint(target.partition(":")[0]),
         lambda target: f"the source file of {target} ({module_file(target.partition(':')[0]) or 'not found now'})"),
    Part(_reference, lambda path: model_fingerprint(path), lambda path: f"the weights of {path}"),
    Part(_teacher, lambda path: folder_fingerprint(path, REWARD_MODEL_FILES), lambda path: f"the weights of {path}"),
)


def fingerprints(cfg: Any) -> dict[str, str | None]:
    """``{recipe key: fingerprint}`` of every file that defines the objective of ``cfg`` (see :data:`PARTS`): what
    a checkpoint's manifest records as ``objective``."""
    return {key: part.fingerprint(value) for part in PARTS for key, value in part.keys(cfg)}


def changes(cfg: Any, stored: dict[str, Any], checkpoint: str) -> list[str]:
    """One line per key of ``stored`` (a manifest's ``objective``) whose file changed since ``checkpoint`` (its
    name), named as a resume refusal names it. A key that only one side has comes from a recipe key that differs,
    which the recipe diff lists already."""
    lines = []
    for part in PARTS:
        for key, value in part.keys(cfg):
            if key not in stored:
                continue
            before, now = stored[key], part.fingerprint(value)
            if before != now:
                lines.append(f"{key}: {part.what(value)} changed since {checkpoint} (sha256 {_short(before)} -> "
                             f"{_short(now)})")
    return lines


def _short(fingerprint: Any) -> str:
    """A fingerprint as a line shows it: 12 hex digits of a sha256, a name or revision in full, or 'none'."""
    if fingerprint is None:
        return "none"
    text = str(fingerprint)
    return text if ":" in text else text[:12]


def folder_fingerprint(path: str, patterns: tuple[str, ...]) -> str | None:
    """sha256 over the names and contents of the files in folder ``path`` that match ``patterns`` (relative globs),
    in name order; None when there is no such folder or no such file."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    files = sorted({f for pattern in patterns for f in folder.glob(pattern) if f.is_file()})
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(folder).as_posix()}\0{file_sha256(file)}\n".encode())
    return digest.hexdigest()


def model_fingerprint(path: str) -> str | None:
    """``model.path``'s fingerprint: its weights and config (:func:`folder_fingerprint`) when it is a local folder;
    for a hub id the revision the local hub cache resolved ``main`` to (``revision:<commit>``), or the id itself
    (``name:<id>``) when the cache does not know it, as for a ``pkg://`` path (whose folder only its code knows)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder_fingerprint(path, MODEL_FILES)
    if "://" not in path:
        revision = _cached_revision(path)
        if revision:
            return f"revision:{revision}"
    return f"name:{path}"


def _cached_revision(repo: str) -> str | None:
    """The commit the hub cache resolved ``repo``'s main branch to, read from its refs file; None if unknown."""
    from huggingface_hub import constants  # lazy: heavy (where the hub cache is, as every hub download sees it)

    ref = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "refs" / "main"
    try:
        return ref.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def source_fingerprint(module: str) -> str | None:
    """sha256 of the source file of ``module`` (:func:`module_file`), None when it has none."""
    found = module_file(module)
    return file_sha256(found) if found is not None else None


def module_file(module: str) -> Path | None:
    """The file that importing ``module`` would run, found without importing anything: the top package is looked
    up as ``importlib.util.find_spec`` finds it (the import system's finders only), each further part in its
    parent's folders (``importlib.util.find_spec("a.b")`` would import ``a``, running its code). None when it is
    not found, or is not a file (a built-in, a namespace package)."""
    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for i in range(1, len(parts)):
            if spec is None or spec.submodule_search_locations is None:
                return None
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]),
                                                              list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.has_location or not spec.origin:
        return None
    origin = Path(spec.origin)
    return origin if origin.is_file() else None


_HASHED: dict[tuple[str, int, int, int], str] = {}  # (path, inode, size, mtime_ns) -> sha256, this process
_HASHED_LOCK = threading.Lock()  # a checkpoint's manifest may be written on a publishing thread


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (streamed: :func:`finetune.storage.rundir.sha256_file`), once per process while
    the file's identity, size and modification time stay the same."""
    real = os.path.realpath(path)
    status = os.stat(real)
    key = (real, status.st_ino, status.st_size, status.st_mtime_ns)
    with _HASHED_LOCK:
        known = _HASHED.get(key)
    if known is None:
        known = rundir.sha256_file(Path(real))
        with _HASHED_LOCK:
            _HASHED[key] = known
    return known
