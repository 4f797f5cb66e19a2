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

Everything read here is data: safetensors, JSON, and ``torch.load`` with ``weights_only`` (forced for the whole
process by finetune.artifacts.checkpoint.forbid_unpickling, with the backend's own records allow-listed by
finetune.backends.restrict_checkpoint_loading).
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.artifacts.checkpoint import KERNEL_KEYS, forbid_unpickling, keep_kernel_choice
from finetune.backends import Backend, backend_named, restrict_dcp_metadata
from finetune.errors import RunDirError
from finetune.storage import layout, rundir
from finetune.storage.checkpoints import read_state

PARAM_NAMES = "param_names"
"""The checkpointed object (``param_names.json``) that names the optimizer's parameters: what makes a checkpoint
portable. Checkpoints written before it existed resume only on their own layout (or single <-> DDP)."""

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter moments, what DeepSpeed's universal format holds
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
_UNIVERSAL = "universal"  # inside the scratch folder: DeepSpeed's universal checkpoint
_CONVERTED = "converted.json"  # inside the scratch folder: written last, once the conversion is complete


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
    with _quiet():  # (registering DeepSpeed's records imports DeepSpeed, which prints)
        forbid_unpickling(backend)  # data only, also in a process that is not a training worker (finetune export)
    groups = _param_groups(ckpt, manifest) if optimizer else None
    read = backend.pick(whole=lambda: _read_whole(ckpt, groups), fsdp=lambda: _read_fsdp(ckpt, backend, groups),
                        deepspeed=lambda: _read_deepspeed(ckpt, groups, scratch))
    model, optim = read()
    return FullState(model, optim, name, world)


def _param_groups(ckpt: Path, manifest: dict[str, Any]) -> list[list[str]]:

    if not _has_names(manifest):
        raise RunDirError(f"{ckpt}: {reshard_problem(manifest)}; its optimizer cannot be read on another layout")
    groups = read_state(ckpt, PARAM_NAMES).get("groups")
    if not isinstance(groups, list) or not all(isinstance(g, list) and all(isinstance(n, str) for n in g)
                                               for g in groups):
        raise RunDirError(f"{ckpt / (PARAM_NAMES + '.json')}: not a list of parameter-name lists")
    return groups


def _strip_prefix(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``state`` without ``prefix`` on its keys when every key has it (a wrapper's name, e.g. DDP's ``module.``)."""
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def _by_name(optim: dict[str, Any], groups: list[list[str]], where: Path) -> dict[str, Any]:
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


def _read_whole(ckpt: Path, groups: list[list[str]] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """single / DDP: ``model.safetensors`` (adapter-only for LoRA) and ``optimizer.bin`` (state by index)."""
    import torch  # lazy: heavy
    from safetensors.torch import load_file  # lazy: heavy

    model = _strip_prefix(load_file(str(ckpt / "model.safetensors")), "module.")
    if groups is None:
        return model, None
    optim = torch.load(ckpt / "optimizer.bin", map_location="cpu", weights_only=True)  # safe: data only
    return model, _by_name(optim, groups, ckpt / "optimizer.bin")


def _read_dcp(folder: Path) -> dict[str, Any]:
    """Every key of a torch.distributed.checkpoint folder, loaded whole in this process without a process group
    (what torch's own ``format_utils.dcp_to_torch_save`` does; the public ``dcp.load`` fills only keys it is
    given)."""
    from torch.distributed.checkpoint import FileSystemReader  # lazy: heavy
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # lazy: heavy
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # lazy: heavy


    restrict_dcp_metadata()
    state: dict[str, Any] = {}
    with _quiet():
        _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return state


def _in_groups(state: dict[str, Any], param_groups: list[dict[str, Any]], groups: list[list[str]],
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


def _read_fsdp(ckpt: Path, backend: Backend, groups: list[list[str]] | None
               ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """FSDP1 / FSDP2: the DCP model folder (clean FQN keys); the optimizer from FSDP1's whole copy
    (``fsdp1_optimizer``) or FSDP2's DCP optimizer folder."""

    model = _read_dcp(ckpt / "pytorch_model_fsdp_0").get("model")
    if not isinstance(model, dict):
        raise RunDirError(f"{ckpt / 'pytorch_model_fsdp_0'}: holds no model state")
    model = {k: v.contiguous() for k, v in model.items()}
    if groups is None:
        return model, None
    if backend.fsdp_version == 1:
        optim = read_state(ckpt, "fsdp1_optimizer")
    else:
        optim = _read_dcp(ckpt / "optimizer_0").get("optimizer")
    if not isinstance(optim, dict) or not isinstance(optim.get("param_groups"), list):
        raise RunDirError(f"{ckpt}: holds no FSDP optimizer state")
    return model, _in_groups(optim.get("state") or {}, optim["param_groups"], groups, ckpt)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Third-party progress prints and bars (DeepSpeed's converter, DCP's warnings) go nowhere."""

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _read_deepspeed(ckpt: Path, groups: list[list[str]] | None, scratch: Path | None
                    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """DeepSpeed ZeRO 1/2/3: the model through DeepSpeed's zero_to_fp32 (fp32 masters of the trainable parameters,
    frozen parameters and buffers as saved; ZeRO-1's frozen parameters from its model states file, see
    :func:`_zero12_frozen`); the optimizer through DeepSpeed's universal checkpoint (one folder per
    parameter with its fp32 value and Adam moments), converted into ``scratch``."""
    with _quiet():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # lazy: heavy

        model = {k: v.detach() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
                 .items()}
    model.update(_zero12_frozen(ckpt / "pytorch_model", model))
    if groups is None:
        return model, None
    if scratch is None:
        raise ValueError("reading a DeepSpeed optimizer needs a scratch folder")
    universal = convert_deepspeed(ckpt, scratch)
    return model, _read_universal(universal, groups, model, ckpt)


def _zero12_frozen(folder: Path, model: dict[str, Any]) -> dict[str, Any]:
    """The parameters of a ZeRO-1/2 checkpoint that zero_to_fp32 does not return: the frozen ones of ZeRO-1.

    DeepSpeed's engine records ``frozen_param_shapes`` / ``frozen_param_fragments`` (what zero_to_fp32 reads frozen
    parameters from) only from ZeRO-2 on (``zero_optimization_partition_gradients``), so a ZeRO-1 checkpoint, in
    fp32 as in bf16, yields its trainable fp32 masters and buffers alone. Under ZeRO 1/2 every rank keeps the whole
    module, and the model states file (``mp_rank_00_model_states.pt``, "module") holds its full state dict: frozen
    parameters included, whole, in the engine's dtype. They are taken from there, as saved: under bf16 they are the
    bf16 values DeepSpeed cast the module to when it built the engine (it keeps no fp32 copy of a parameter no
    optimizer steps), which are the values the run trained with and exported (fp32 weights before that are lost).
    ZeRO-3's model states hold partitioned placeholders, and its frozen parameters are recorded: nothing is taken."""
    import torch  # lazy: heavy

    states = folder / "mp_rank_00_model_states.pt"  # (ZeRO-3's is zero_pp_rank_0_mp_rank_00_model_states.pt)
    if not states.is_file():
        return {}
    saved = torch.load(states, map_location="cpu", weights_only=True)  # safe: data only
    module = saved.get("module") if isinstance(saved, dict) else None
    if not isinstance(module, dict):
        raise RunDirError(f"{states}: holds no module state")
    return {k: v.detach() for k, v in module.items() if k not in model and torch.is_tensor(v)}


def convert_deepspeed(ckpt: Path, scratch: Path) -> Path:
    """DeepSpeed's universal checkpoint of ``ckpt`` in ``scratch`` (converted now unless a complete conversion of
    this very checkpoint is there already); returns its folder. The checkpoint itself is only read."""

    if not scratch.name.endswith(rundir.TMP):
        raise AssertionError(f"not a scratch folder: {scratch}")
    done, out = scratch / _CONVERTED, scratch / _UNIVERSAL
    source = str(ckpt.resolve())
    if done.is_file() and json.loads(done.read_text(encoding="utf-8")).get("source") == source:
        return out
    if scratch.exists():
        rundir.remove_scratch(scratch)
    scratch.mkdir(parents=True)
    with _quiet():
        from deepspeed.checkpoint import ds_to_universal  # lazy: heavy

        args = Namespace(input_folder=str(ckpt / "pytorch_model"), output_folder=str(out), num_extract_workers=1,
                         num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        ds_to_universal.main(args)  # (its own temporary files stay inside the scratch, which is removed whole)
    done.write_text(json.dumps({"source": source}), encoding="utf-8")
    return out


def _universal_tensor(path: Path) -> Any:
    import torch  # lazy: heavy

    value = torch.load(path, map_location="cpu", weights_only=True)  # safe: data only
    return value.get("param") if isinstance(value, dict) else value


def _read_universal(universal: Path, groups: list[list[str]], model: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """The FQN-keyed optimizer state of a universal checkpoint (``zero/<fqn>/{fp32,exp_avg,exp_avg_sq,step}.pt``
    and ``zero/optimizer_state.pt``). Its fp32 values must equal zero_to_fp32's: two DeepSpeed tools, one truth."""
    import torch  # lazy: heavy

    zero = universal / "zero"
    common = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=True)  # safe: data only
    saved_groups = common.get("param_groups") or []
    if len(saved_groups) != len(groups):
        raise RunDirError(f"{ckpt}: {len(saved_groups)} optimizer param groups, but {PARAM_NAMES}.json names "
                          f"{len(groups)}; the checkpoint is inconsistent")
    step = _universal_step(common)
    state: dict[str, Any] = {}
    for name in (n for names in groups for n in names):
        folder = zero / name
        if not (folder / "fp32.pt").is_file():
            raise RunDirError(f"{ckpt}: DeepSpeed's universal checkpoint has no state for {name}")
        if name not in model:
            raise RunDirError(f"{ckpt}: zero_to_fp32 found no weights for {name}; the checkpoint is inconsistent")
        shape = model[name].shape  # (ZeRO-3's universal tensors are flat)
        fp32 = _universal_tensor(folder / "fp32.pt").reshape(shape)
        if not torch.equal(fp32, model[name].float()):
            raise AssertionError(f"DeepSpeed's universal and zero_to_fp32 values of {name} differ")
        entry = {key: _universal_tensor(folder / f"{key}.pt").reshape(shape)
                 for key in _ADAM_KEYS if (folder / f"{key}.pt").is_file()}
        own_step = _universal_tensor(folder / "step.pt") if (folder / "step.pt").is_file() else step
        if own_step is None:
            raise RunDirError(f"{ckpt}: DeepSpeed's universal checkpoint has no optimizer step for {name}")
        entry["step"] = torch.as_tensor(float(own_step), dtype=torch.float32)
        state[name] = entry
    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
                    for g, names in zip(saved_groups, groups, strict=True)]
    return {"state": state, "param_groups": param_groups}


def _universal_step(common: dict[str, Any]) -> Any:
    """ZeRO-3's converter keeps the optimizer step in the common state (ZeRO 1/2 write it per parameter)."""
    inner = common.get("optimizer_state_dict")
    if isinstance(inner, dict):
        for value in (inner.get("state") or {}).values():
            if isinstance(value, dict) and "step" in value:
                return value["step"]
    return None


# --- whole tensors into a model -------------------------------------------------------------------------------------


def clean_name(name: str) -> str:
    """A parameter name without the wrappers' parts (FSDP1, activation checkpointing, torch.compile)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _tied_aliases(model: Any) -> dict[str, str]:
    """Names under which a parameter is reachable besides its first name (tied weights): alias -> first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[clean_name(name)] = first[id(param)]
        else:
            first[id(param)] = clean_name(name)
    return aliases


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


def _check_keys(missing: list[str], unexpected: list[str], allowed_missing: set[str], what: str) -> None:
    missing = sorted(k for k in missing if k not in allowed_missing)
    if unexpected:
        raise RunDirError(f"{what}: the checkpoint holds {sorted(unexpected)[0]}"
                          f"{f' (and {len(unexpected) - 1} more keys)' if len(unexpected) > 1 else ''}, which this "
                          "model does not have; the checkpoint is of another model or configuration")
    if missing:
        raise RunDirError(f"{what}: the checkpoint lacks {missing[0]}"
                          f"{f' (and {len(missing) - 1} more keys)' if len(missing) > 1 else ''}; the checkpoint is "
                          "of another model or configuration")


def apply_model_state(model: Any, state_dict: dict[str, Any]) -> None:
    """Load a FullState's model into an UNWRAPPED plain or PEFT model: full keys, or (PEFT) peft's adapter-only
    keys through ``peft.set_peft_model_state_dict``. Tied-weight aliases may be missing; any other missing or
    unexpected key is a RunDirError naming it."""
    if _is_adapter_only(model, state_dict):
        from peft import get_peft_model_state_dict, set_peft_model_state_dict  # lazy: heavy

        expected = set(get_peft_model_state_dict(model))
        _check_keys(sorted(expected - set(state_dict)), sorted(set(state_dict) - expected), set(), "adapter")
        result = set_peft_model_state_dict(model, state_dict)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        _check_keys([], unexpected, set(), "adapter")
        return
    result = model.load_state_dict(state_dict, strict=False)
    _check_keys(list(result.missing_keys), list(result.unexpected_keys), set(_tied_aliases(model)), "model")


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
    choice, finetune.artifacts.checkpoint.KERNEL_KEYS, is kept)."""
    if state.optimizer is None:
        raise ValueError("a resume needs the optimizer state: read_full_state(..., optimizer=True)")
    unwrapped = accelerator.unwrap_model(model)
    full, adapter_only = _full_keys(unwrapped, state)
    if backend.pick(whole=False, fsdp=False, deepspeed=True):  # the engine holds its own optimizer partitions
        _load_deepspeed(model, optimizer, full, state.optimizer, unwrapped)
    else:
        _load_torch(model, optimizer, full, state.optimizer, unwrapped, adapter_only)


def _live_groups(saved: dict[str, Any], inner: Any) -> dict[str, Any]:
    """``saved`` with this build's kernel keys in every param group (what the checkpoint says is how that machine
    computed a step, not what the step is; finetune.artifacts.checkpoint.keep_kernel_choice)."""

    if len(saved["param_groups"]) != len(inner.param_groups):
        raise RunDirError(f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this one "
                          f"{len(inner.param_groups)}; the checkpoint is of another configuration")
    groups = [{**g, **{k: live[k] for k in KERNEL_KEYS if k in live}}
              for g, live in zip(saved["param_groups"], inner.param_groups, strict=True)]
    return {"state": saved["state"], "param_groups": groups}


def _load_torch(model: Any, optimizer: Any, full: dict[str, Any], optim: dict[str, Any], unwrapped: Any,
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
    allowed = set(_tied_aliases(unwrapped))
    if adapter_only:  # a LoRA checkpoint of whole tensors holds the trainable parameters only (the base is built)
        allowed |= {clean_name(k) for k in result.missing_keys if clean_name(k) not in trainable}
    _check_keys([clean_name(k) for k in result.missing_keys], [clean_name(k) for k in result.unexpected_keys],
                allowed, "model")
    choice = [{k: g[k] for k in KERNEL_KEYS if k in g} for g in inner.param_groups]
    set_optimizer_state_dict(model, inner, optim_state_dict=_live_groups(optim, inner), options=options)
    keep_kernel_choice(inner, choice)


def _deepspeed_flat_params(zero: Any) -> list[Any]:
    """The fp32 flat partitions a ZeRO optimizer steps (one per param group or sub-group)."""
    flat = getattr(zero, "fp32_partitioned_groups_flat", None)  # ZeRO-3
    return list(flat if flat is not None else zero.single_partition_of_fp32_groups)  # ZeRO 1/2


def _load_deepspeed(engine: Any, optimizer: Any, full: dict[str, Any], optim: dict[str, Any],
                    unwrapped: Any) -> None:
    """DeepSpeed ZeRO 1/2/3: the fp32 masters and Adam moments through deepspeed.utils' safe_set_full_* (each rank
    keeps its partition), the module's own (low-precision) weights from the same values, the base optimizer's step
    counts and the param groups' hyperparameters (lr included) from the checkpoint."""
    import torch  # lazy: heavy
    from deepspeed.utils import (
        lazy_init_hp_params_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )  # lazy: heavy

    zero = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    base = zero.optimizer  # the torch optimizer it steps on its flat fp32 partitions
    saved = _live_groups(optim, base)
    names = {clean_name(n): p for n, p in unwrapped.named_parameters()}
    unexpected = sorted(k for k in full if k not in names and k not in dict(unwrapped.named_buffers()))
    _check_keys([], unexpected, set(), "model")
    steps = {float(s["step"]) for s in saved["state"].values() if "step" in s}
    if len(steps) > 1:
        raise RunDirError(f"the checkpoint's optimizer step counts differ between parameters ({sorted(steps)}); "
                          "DeepSpeed keeps one per param group")
    step = steps.pop() if steps else 0.0
    keys = sorted({k for s in saved["state"].values() for k, v in s.items() if k != "step" and torch.is_tensor(v)})
    for flat in _deepspeed_flat_params(zero):  # torch's optimizers create their state at the first step: now
        entry = base.state[flat]
        entry.setdefault("step", torch.tensor(step, dtype=torch.float32))
        entry["step"] = torch.tensor(step, dtype=entry["step"].dtype) if torch.is_tensor(entry["step"]) else step
        for key in keys:
            entry.setdefault(key, torch.zeros_like(flat))
    if hasattr(zero, "bit16_groups"):  # ZeRO 1/2 point each parameter at its fragment of that state once linked
        for lp_group, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True):
            lazy_init_hp_params_optimizer_state(lp_group, flat, base.state)
        zero._hp_optimizer_states_linked = True
    trainable = [(n, p) for n, p in names.items() if p.requires_grad]
    for name, param in trainable:
        if name not in full:
            raise RunDirError(f"model: the checkpoint lacks {name}; the checkpoint is of another model or "
                              "configuration")
        safe_set_full_fp32_param(param, full[name].float())
        for key in keys:
            if name in saved["state"] and key in saved["state"][name]:
                safe_set_full_optimizer_state(param, saved["state"][name][key].float(), key)
    _set_module_weights(engine, unwrapped, names, full)
    for group, loaded in zip(base.param_groups, saved["param_groups"], strict=True):
        group.update({k: v for k, v in loaded.items() if k != "params"})


def _set_module_weights(engine: Any, unwrapped: Any, params: dict[str, Any], full: dict[str, Any]) -> None:
    """The module's own parameters (what the next forward uses; low precision under bf16) and buffers from
    ``full``. ZeRO-3 parameters are gathered, set on every rank and partitioned again (deepspeed.zero's
    GatheredParameters); ZeRO 1/2 keep whole parameters on every rank."""
    import torch  # lazy: heavy

    todo = [(name, p) for name, p in params.items() if name in full]
    zero3 = [p for _, p in todo if hasattr(p, "ds_id")]
    ctx: Any = contextlib.nullcontext()
    if zero3:
        import deepspeed  # lazy: heavy

        ctx = deepspeed.zero.GatheredParameters(zero3, modifier_rank=0)
    with ctx, torch.no_grad():
        for name, param in todo:
            param.data.copy_(full[name].reshape(param.data.shape).to(param.dtype))
    buffers = dict(unwrapped.named_buffers())
    with torch.no_grad():
        for name, buffer in buffers.items():
            key = clean_name(name)
            if key in full and full[key].shape == buffer.shape:
                buffer.copy_(full[key].to(buffer.dtype))


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

