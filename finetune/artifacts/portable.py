"""Portable state: a checkpoint of any backend and world size as whole tensors, and whole tensors into any backend.

A checkpoint is written in its backend's own format (finetune.artifacts.checkpoint): whole tensors for single/DDP,
per-rank shards for FSDP (torch.distributed.checkpoint folders) and DeepSpeed ZeRO (per-rank partition files). The
native load reads it only on the layout that wrote it. This module is the one way between layouts:

- :func:`read_full_state`: one process, CPU, no process group, any format -> :class:`FullState`: the model's full
  tensors by the unwrapped model's state-dict key (fp32 masters where the backend keeps them) and torch's "full
  optimizer state dict" keyed by parameter FQN. Optimizer files that key state by parameter INDEX (single/DDP's
  ``optimizer.bin``) are mapped through the parameter names every checkpoint records (``param_names.json``,
  :class:`ParamNames`); DeepSpeed's partitions go through DeepSpeed's own universal-checkpoint converter into a
  scratch folder the caller owns.
- :func:`apply_model_state`: a FullState's model into an unwrapped plain or PEFT model (``finetune export``).
- :func:`load_full_state`: a FullState into the built, prepared model and optimizer of any backend, on every rank.
- :func:`resume_targets` / :func:`reshard_problem`: where a checkpoint can resume, from its manifest alone.

How one family's files are read and how whole tensors go into one family's built model is that family's own answer
(:meth:`finetune.backends.base.Backend.read_full_state` / :meth:`~finetune.backends.base.Backend.load_full_state`:
safetensors in :mod:`finetune.backends.whole`, DCP folders in :mod:`finetune.backends.fsdp`, DeepSpeed's converters
and engine in :mod:`finetune.backends.deepspeed`, the parts they share in :mod:`finetune.backends.fullstate`). This
module holds what is the same for every layout: the manifest's checks, the parameter names, peft's adapter keys
and the order of a resume.

Everything read here is data: safetensors, JSON, and ``torch.load`` with ``weights_only`` (forced for the whole
process by finetune.artifacts.checkpoint.forbid_unpickling, with the backend's own records allow-listed by
finetune.backends.restrict_checkpoint_loading).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.artifacts.checkpoint import forbid_unpickling
from finetune.backends import Backend, backend_named
from finetune.backends.fullstate import PARAM_NAMES, check_keys, clean_name, quiet, tied_aliases
from finetune.errors import RunDirError
from finetune.storage import layout, rundir
from finetune.storage.checkpoints import read_state

__all__ = ["PARAM_NAMES", "FullState", "ParamNames", "apply_model_state", "clean_name", "load_full_state", "peft_key",
           "read_full_state", "reshard_problem", "resume_from", "resume_targets"]



@dataclass
class FullState:
    """A checkpoint's model and optimizer as whole tensors on the CPU, independent of any layout.

    ``model``: state-dict key -> tensor (adapter-only keys in peft's form for single/DDP LoRA checkpoints).
    ``optimizer``: ``{"state": {fqn: {"step", "exp_avg", ...}}, "param_groups": [{..., "params": [fqn, ...]}]}``,
    or None when it was not asked for. ``backend`` / ``world_size``: the layout that wrote the checkpoint."""

    model: dict[str, Any]
    optimizer: dict[str, Any] | None
    backend: str = "single"
    world_size: int = 1


class ParamNames:
    """Checkpointed with a run's other objects (as ``param_names.json``): the optimizer's param groups as lists of
    parameter FQNs, taken on the plain model before ``accelerator.prepare`` wraps it. A checkpoint whose optimizer
    file keys its state by parameter index becomes readable on any layout through it. Loading it changes nothing
    (the live names are this build's); a checkpoint written before it existed simply has none."""

    # finetune.artifacts.checkpoint.load: an older checkpoint without it still loads natively
    optional_in_checkpoint = True

    def __init__(self, groups: list[list[str]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, model: Any, optimizer: Any) -> ParamNames:
        """The names of ``optimizer``'s parameters in ``model`` (both plain: call before accelerator.prepare)."""
        names = {id(param): name for name, param in model.named_parameters()}
        inner = getattr(optimizer, "optimizer", optimizer)
        return cls([[names[id(param)] for param in group["params"]] for group in inner.param_groups])

    def state_dict(self) -> dict[str, Any]:
        return {"groups": self.groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the names describe the checkpoint, the live ones come from this build."""


# --- where a checkpoint can resume ---------------------------------------------------------------------------------


def _has_names(manifest: dict[str, Any]) -> bool:
    return f"{PARAM_NAMES}.json" in (manifest.get("files") or {})


def _saved_layout(manifest: dict[str, Any]) -> tuple[str, int]:
    saved = layout.of(manifest)
    return saved.backend, saved.world_size or 1


def reshard_problem(manifest: dict[str, Any], optimizer: str = "adamw") -> str | None:
    """Why this checkpoint cannot be read into another layout (None when it can): it must name its parameters
    (``param_names.json``, written by every checkpoint since portable resume exists) and be of a known backend.
    ``optimizer`` (``optim.name``): DeepSpeed's universal-checkpoint converter reads Adam's moments only."""
    backend, _ = _saved_layout(manifest)
    try:
        saved = backend_named(backend)
    except ValueError:
        return f"it was written by an unknown backend {backend!r}"
    if not _has_names(manifest):
        return f"it records no parameter names ({PARAM_NAMES}.json; written before finetune resharded checkpoints)"
    return saved.reshard_problem(optimizer)


def _whole(name: str) -> bool:
    """Whether backend ``name`` writes whole tensors (False for a name no backend has)."""
    try:
        return backend_named(name).whole_tensors
    except ValueError:
        return False


def resume_targets(manifest: dict[str, Any]) -> str:
    """Where a checkpoint can resume, in a few words (``finetune ls``)."""
    backend, world = _saved_layout(manifest)
    if reshard_problem(manifest) is None:
        return "any world size, any backend"
    why = "no param names" if not _has_names(manifest) else "unknown backend"
    if _whole(backend):
        return f"any world size, single or ddp only ({why})"
    return f"same layout only: {backend} on {world} process(es) ({why})"


# --- reading any checkpoint into a FullState ------------------------------------------------------------------------


def read_full_state(ckpt: Path, *, optimizer: bool = True, scratch: Path | None = None,
                    manifest: dict[str, Any] | None = None) -> FullState:
    """The model (and with ``optimizer`` the optimizer) of checkpoint ``ckpt`` as whole CPU tensors, in this one
    process, without a process group, whatever backend and world size wrote it.

    ``scratch``: a ``.tmp`` folder the caller owns, needed to read a DeepSpeed checkpoint's optimizer (DeepSpeed's
    universal-checkpoint converter writes there; the caller removes it). When it already holds a complete
    conversion of ``ckpt`` (another rank made it), that is read instead of converting again. ``manifest``: the
    checkpoint's manifest when the caller has read it already (else read here)."""

    manifest = rundir.read_manifest(ckpt) if manifest is None else manifest
    name, world = _saved_layout(manifest)
    try:
        backend = backend_named(name)
    except ValueError:
        raise RunDirError(f"{ckpt}: written by an unknown backend {name!r}; it cannot be read here") from None
    with quiet():  # (registering DeepSpeed's records imports DeepSpeed, which prints)
        forbid_unpickling(backend)  # data only, also in a process that is not a training worker (finetune export)
    groups = _param_groups(ckpt, manifest) if optimizer else None
    model, optim = backend.read_full_state(ckpt, groups, scratch)
    return FullState(model, optim, name, world)


def _param_groups(ckpt: Path, manifest: dict[str, Any]) -> list[list[str]]:

    if not _has_names(manifest):
        raise RunDirError(f"{ckpt}: {reshard_problem(manifest)}; its optimizer cannot be read on another layout")
    groups = read_state(ckpt, PARAM_NAMES).get("groups")
    if not isinstance(groups, list) or not all(isinstance(g, list) and all(isinstance(n, str) for n in g)
                                               for g in groups):
        raise RunDirError(f"{ckpt / (PARAM_NAMES + '.json')}: not a list of parameter-name lists")
    return groups


# --- whole tensors into a model -------------------------------------------------------------------------------------


def _adapter_name(model: Any) -> str | None:
    """The active adapter of a PEFT model (None for a plain model)."""
    if not hasattr(model, "peft_config"):
        return None
    active = getattr(model, "active_adapter", "default")
    return active if isinstance(active, str) else active[0]


def _is_adapter_only(model: Any, state: dict[str, Any]) -> bool:
    """Whether ``state`` holds peft's adapter-only keys (``get_peft_model_state_dict``: the adapter name removed)
    rather than the PEFT model's full keys."""
    adapter = _adapter_name(model)
    return adapter is not None and bool(state) and not any(f".{adapter}." in key for key in state)


def peft_key(full: str, adapter: str = "default") -> str:
    """The key peft's adapter-only state dict uses for the PEFT model's full key ``full`` (peft's renaming: a
    ``modules_to_save`` copy is saved under the module's own name, and the adapter's name is dropped)."""
    return full.replace("modules_to_save.", "").replace(f".{adapter}", "")


def apply_model_state(model: Any, state_dict: dict[str, Any]) -> None:
    """Load a FullState's model into an UNWRAPPED plain or PEFT model: full keys, or (PEFT) peft's adapter-only
    keys through ``peft.set_peft_model_state_dict``. Tied-weight aliases may be missing; any other missing or
    unexpected key is a RunDirError naming it."""
    if _is_adapter_only(model, state_dict):
        from peft import get_peft_model_state_dict, set_peft_model_state_dict  # lazy: heavy

        expected = set(get_peft_model_state_dict(model))
        check_keys(sorted(expected - set(state_dict)), sorted(set(state_dict) - expected), set(), "adapter")
        result = set_peft_model_state_dict(model, state_dict)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        check_keys([], unexpected, set(), "adapter")
        return
    result = model.load_state_dict(state_dict, strict=False)
    check_keys(list(result.missing_keys), list(result.unexpected_keys), set(tied_aliases(model)), "model")


def _full_keys(model: Any, state: FullState) -> tuple[dict[str, Any], bool]:
    """``state.model`` under the (unwrapped) model's full keys, and whether it held peft's adapter-only keys: those
    are mapped back through the trainable parameters' names (the optimizer's), since those are exactly what an
    adapter checkpoint holds."""
    if not _is_adapter_only(model, state.model):
        return dict(state.model), False
    adapter = _adapter_name(model) or "default"
    names = [n for g in (state.optimizer or {}).get("param_groups", []) for n in g["params"]]
    if not names:
        names = [clean_name(n) for n, p in model.named_parameters() if p.requires_grad]
    back = {peft_key(name, adapter): name for name in names}
    unknown = sorted(k for k in state.model if k not in back)
    if unknown:
        raise RunDirError(f"adapter: the checkpoint holds {unknown[0]}, which no trainable parameter of this model "
                          "matches; the checkpoint is of another model or adapter configuration")
    return {back[k]: v for k, v in state.model.items()}, True


# --- whole tensors into a built, prepared model and optimizer -----------------------------------------------------


def load_full_state(accelerator: Any, backend: Backend, model: Any, optimizer: Any, state: FullState) -> None:
    """Load ``state`` into the built and prepared ``model`` / ``optimizer`` of ``backend``; every rank calls this
    with the same ``state``. After it the next forward uses the loaded weights and the next optimizer step is the
    one the saved run would have taken (moments, step counts, param-group hyperparameters; this build's kernel
    choice, finetune.backends.fullstate.KERNEL_KEYS, is kept)."""
    if state.optimizer is None:
        raise ValueError("a resume needs the optimizer state: read_full_state(..., optimizer=True)")
    full, adapter_only = _full_keys(accelerator.unwrap_model(model), state)
    backend.load_full_state(accelerator, model, optimizer, full, state.optimizer, adapter_only=adapter_only)


# --- the resume path ----------------------------------------------------------------------------------------------


def resume_from(accelerator: Any, backend: Backend, model: Any, optimizer: Any, ckpt: Path, run_dir: Path,
                manifest: dict[str, Any] | None = None) -> None:
    """Load checkpoint ``ckpt`` (written on another layout) into this build's model and optimizer on every rank:
    rank 0 converts what needs converting into the run's scratch folder first while the others wait; every rank
    then reads the whole state and keeps its part; rank 0 removes the scratch. ``manifest``: as read by the caller."""
    scratch = rundir.reshard_scratch(run_dir)
    main = accelerator.is_main_process
    try:
        if main:
            if scratch.exists():
                rundir.remove_scratch(scratch)  # left by a crash: never trusted
            state = read_full_state(ckpt, scratch=scratch, manifest=manifest)
        accelerator.wait_for_everyone()
        if not main:
            state = read_full_state(ckpt, scratch=scratch, manifest=manifest)
        accelerator.wait_for_everyone()
    finally:
        if main and scratch.exists():
            rundir.remove_scratch(scratch)
    load_full_state(accelerator, backend, model, optimizer, state)

