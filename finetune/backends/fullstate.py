"""What every backend family shares when it reads a checkpoint as one full state or loads one into a built model.

Each family answers for its own layout (:meth:`finetune.backends.base.Backend.read_full_state` and
:meth:`~finetune.backends.base.Backend.load_full_state`, in whole.py, fsdp.py and deepspeed.py); the orchestration
above them (which checkpoint, the manifest's checks, the scratch folder, peft's adapter keys) is
finetune.artifacts.portable. What sits here is independent of any layout and needed by more than one family: the
parameter names without the wrappers' parts, optimizer states re-keyed by parameter name, the one check of missing
and unexpected keys, this build's optimizer kernel choice, and the torch families' loader (single, DDP and FSDP all
load through torch.distributed.checkpoint's state-dict setters). It lives in this package, not in
finetune.artifacts, because the backends may not import upwards. Nothing here imports torch at import time.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from finetune.errors import RunDirError

PARAM_NAMES = "param_names"
"""The checkpointed object (``param_names.json``) that names the optimizer's parameters: what makes a checkpoint
portable. Checkpoints written before it existed resume only on their own layout (or single <-> DDP)."""

ReadState = tuple[dict[str, Any], dict[str, Any] | None]
"""A checkpoint read whole: the model's tensors by state-dict key, and the FQN-keyed optimizer state (or None)."""

_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""Optimizer param-group keys that choose HOW this machine computes a step, not what the step is."""


def kernel_choice(optimizer: Any) -> list[dict[str, Any]]:
    """``optimizer``'s kernel keys now, per param group (what :func:`keep_kernel_choice` puts back after a load)."""
    return [{k: g[k] for k in KERNEL_KEYS if k in g} for g in optimizer.param_groups]


def keep_kernel_choice(optimizer: Any, choice: list[dict[str, Any]]) -> None:
    """Put back this build's kernel choice (``choice``: per param group, the :data:`KERNEL_KEYS` it had before
    the load) after ``load_state_dict``, which copies every group key from the checkpoint.

    Why: a checkpoint written on CPU (plain AdamW) and resumed on CUDA, where ``optim.fused: null`` means fused,
    would otherwise stay unfused (and one from CUDA resumed on CPU would turn fused), against the recipe. The
    optimizer's ``step`` counters move to where that kernel keeps them (the parameter's device as fp32 for fused
    or capturable, the host otherwise); their values are integers, so nothing of the math changes."""
    if len(choice) != len(optimizer.param_groups):
        return
    for group, keys in zip(optimizer.param_groups, choice, strict=True):
        group.update(keys)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None and hasattr(step, "to"):
                device = param.device if on_device else "cpu"
                optimizer.state[param]["step"] = step.to(device=device, dtype=step.dtype)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Third-party progress prints and bars (DeepSpeed's converter, DCP's warnings) go nowhere."""

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --- names ----------------------------------------------------------------------------------------------------------


def clean_name(name: str) -> str:
    """A parameter name without the wrappers' parts (FSDP1, activation checkpointing, torch.compile)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def tied_aliases(model: Any) -> dict[str, str]:
    """Names under which a parameter is reachable besides its first name (tied weights): alias -> first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[clean_name(name)] = first[id(param)]
        else:
            first[id(param)] = clean_name(name)
    return aliases


def strip_prefix(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``state`` without ``prefix`` on its keys when every key has it (a wrapper's name, e.g. DDP's ``module.``)."""
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def check_keys(missing: list[str], unexpected: list[str], allowed_missing: set[str], what: str) -> None:
    """A RunDirError naming the first unexpected key, else the first missing one not in ``allowed_missing`` (tied
    aliases, a LoRA run's frozen base): a checkpoint of another model never loads in part."""
    missing = sorted(k for k in missing if k not in allowed_missing)
    if unexpected:
        raise RunDirError(f"{what}: the checkpoint holds {sorted(unexpected)[0]}"
                          f"{f' (and {len(unexpected) - 1} more keys)' if len(unexpected) > 1 else ''}, which this "
                          "model does not have; the checkpoint is of another model or configuration")
    if missing:
        raise RunDirError(f"{what}: the checkpoint lacks {missing[0]}"
                          f"{f' (and {len(missing) - 1} more keys)' if len(missing) > 1 else ''}; the checkpoint is "
                          "of another model or configuration")


# --- optimizer states by parameter name -----------------------------------------------------------------------------


def by_name(optim: dict[str, Any], groups: list[list[str]], where: Path) -> dict[str, Any]:
    """A torch optimizer state dict keyed by parameter index, keyed by FQN instead (``groups``: the names of each
    param group's parameters, in order)."""
    saved = optim.get("param_groups") or []
    if [len(g.get("params", [])) for g in saved] != [len(g) for g in groups]:
        raise RunDirError(f"{where}: its param groups ({[len(g.get('params', [])) for g in saved]} parameters) do "
                          f"not match {PARAM_NAMES}.json ({[len(g) for g in groups]}); the checkpoint is inconsistent")
    index = {i: name for group, names in zip(saved, groups, strict=True) for i, name in zip(group["params"], names,
                                                                                              strict=True)}
    state = {index[i]: dict(value) for i, value in (optim.get("state") or {}).items()}
    return {"state": state, "param_groups": [{**g, "params": list(names)} for g, names in zip(saved, groups,
                                                                                               strict=True)]}


def in_groups(state: dict[str, Any], param_groups: list[dict[str, Any]], groups: list[list[str]],
              where: Path) -> dict[str, Any]:
    """An FQN-keyed optimizer state whose param groups are re-ordered as ``groups`` (the checkpoint's names);
    every named parameter must be in exactly one saved group."""
    owner = {name: i for i, group in enumerate(param_groups) for name in group.get("params", [])}
    missing = [name for names in groups for name in names if name not in owner]
    if missing:
        raise RunDirError(f"{where}: no optimizer param group holds {missing[0]}; the checkpoint is inconsistent")
    out = []
    for names in groups:
        saved = param_groups[owner[names[0]]] if names else {}
        out.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(names)})
    return {"state": {k: dict(v) for k, v in state.items()}, "param_groups": out}


def live_groups(saved: dict[str, Any], inner: Any) -> dict[str, Any]:
    """``saved`` with this build's kernel keys in every param group (what the checkpoint says is how that machine
    computed a step, not what the step is; :data:`KERNEL_KEYS`)."""

    if len(saved["param_groups"]) != len(inner.param_groups):
        raise RunDirError(f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this one "
                          f"{len(inner.param_groups)}; the checkpoint is of another configuration")
    groups = [{**g, **{k: live[k] for k in KERNEL_KEYS if k in live}}
              for g, live in zip(saved["param_groups"], inner.param_groups, strict=True)]
    return {"state": saved["state"], "param_groups": groups}


# --- the torch families' loader -------------------------------------------------------------------------------------


def load_torch(model: Any, optimizer: Any, full: dict[str, Any], optim: dict[str, Any], unwrapped: Any,
               adapter_only: bool) -> None:
    """single / DDP / FSDP1 / FSDP2: torch.distributed.checkpoint.state_dict with full state dicts (each rank holds
    all of it and keeps its shard). ``adapter_only``: ``full`` holds a LoRA run's trainable parameters only (the
    frozen base is what this build made, as in a native LoRA resume)."""
    import torch  # lazy: heavy
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )  # lazy: heavy

    inner = getattr(optimizer, "optimizer", optimizer)
    options = StateDictOptions(full_state_dict=True, strict=False, cpu_offload=torch.cuda.is_available())
    trainable = {clean_name(n) for n, p in unwrapped.named_parameters() if p.requires_grad}
    result = set_model_state_dict(model, full, options=options)
    allowed = set(tied_aliases(unwrapped))
    if adapter_only:  # a LoRA checkpoint of whole tensors holds the trainable parameters only (the base is built)
        allowed |= {clean_name(k) for k in result.missing_keys if clean_name(k) not in trainable}
    check_keys([clean_name(k) for k in result.missing_keys], [clean_name(k) for k in result.unexpected_keys],
               allowed, "model")
    choice = kernel_choice(inner)
    set_optimizer_state_dict(model, inner, optim_state_dict=live_groups(optim, inner), options=options)
    keep_kernel_choice(inner, choice)
