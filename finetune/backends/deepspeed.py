"""DeepSpeed ZeRO stages 1-3, with optional CPU offload.

The whole DeepSpeed config is generated from the recipe (global/micro batch, accumulation, clipping, precision,
ZeRO stage and offload), so the two can never disagree. The engine owns mixed precision (it casts the model and
keeps fp32 master weights). On CPU-only machines DeepSpeed needs a gloo process group and must NOT get
``cpu=True``, which would silently run DDP (docs/platform-notes.md).
"""

from __future__ import annotations

import contextlib
import json
import os
from argparse import Namespace
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.backends import setup
from finetune.backends.base import Backend, Sharding
from finetune.backends.frozen import FrozenShards
from finetune.backends.fullstate import PARAM_NAMES, ReadState, check_keys, clean_name, live_groups, quiet
from finetune.config import RecipeConfig
from finetune.errors import ConfigError, RunDirError
from finetune.registry import SupportedModel
from finetune.storage import rundir

DEEPSPEED_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (not set by us)
_SHARDING = {(1, False): "ZeRO-1 optimizer partitions", (2, False): "ZeRO-2 optimizer and gradient partitions",
             (3, False): "ZeRO-3 partitions", (3, True): "ZeRO-3 partitions, optimizer on CPU"}
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter moments, what DeepSpeed's universal format holds
_UNIVERSAL = "universal"  # inside the scratch folder: DeepSpeed's universal checkpoint
_CONVERTED = "converted.json"  # inside the scratch folder: written last, once the conversion is complete


@dataclass(frozen=True)
class DeepSpeed(Backend):
    """ZeRO stage ``zero_stage``; ``offload_optimizer`` / ``offload_param``: ``none`` or a device (``cpu``)."""

    zero_stage: int = 2
    offload_optimizer: str = "none"
    offload_param: str = "none"

    kind = "deepspeed"
    package = "deepspeed"

    @classmethod
    def from_name(cls, name: str) -> DeepSpeed | None:
        stage, _, offload = name.removeprefix("zero").partition("_")
        if name.startswith("zero") and stage in ("1", "2", "3") and offload in ("", "offload"):
            return cls(int(stage), offload_optimizer="cpu" if offload else "none")
        return None

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer != "none"

    @property
    def name(self) -> str:
        return f"zero{self.zero_stage}" + ("_offload" if self.offloads_optimizer else "")

    @property
    def engine_owns_precision(self) -> bool:
        return True

    @property
    def shards_parameters(self) -> bool:
        return self.zero_stage >= 3

    @property
    def weight_distribution(self) -> str:
        return "library" if self.zero_stage == 3 else "broadcast"

    @property
    def rank_bound_state(self) -> bool:
        return True

    @property
    def sharding_text(self) -> str:
        return _SHARDING.get((self.zero_stage, self.offloads_optimizer), "unknown")

    @property
    def format_text(self) -> str:
        if self.zero_stage not in (1, 2, 3):
            return "unknown"
        return "DeepSpeed pytorch_model/ (mp_rank_00_model_states.pt + zero_pp_rank_*_optim_states.pt)"

    def reshard_problem(self, optimizer: str) -> str | None:
        if optimizer != "adamw":
            return f"DeepSpeed's universal checkpoint converter reads AdamW state only (optim.name={optimizer})"
        return None

    def restrict_checkpoint_loading(self) -> None:
        """Its optimizer files hold its ZeRO stage enum, its loss scaler's settings and fragment addresses, data
        classes that run no code when rebuilt: they are allowed."""
        import torch  # lazy: heavy
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # lazy: heavy
        from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: heavy
        from deepspeed.utils.tensor_fragment import fragment_address  # lazy: heavy

        torch.serialization.add_safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address])

    def read_full_state(self, ckpt: Path, groups: list[list[str]] | None, scratch: Path | None) -> ReadState:
        """The model through DeepSpeed's zero_to_fp32 (fp32 masters of the trainable parameters, frozen parameters
        and buffers as saved; ZeRO-1's frozen parameters from its model states file, see :func:`_zero12_frozen`);
        the optimizer through DeepSpeed's universal checkpoint (one folder per parameter with its fp32 value and
        Adam moments), converted into ``scratch`` (:func:`convert_deepspeed`)."""
        with quiet():
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # lazy: heavy

            model = {k: v.detach() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(ckpt),
                                                                                         tag="pytorch_model").items()}
        model.update(_zero12_frozen(ckpt / "pytorch_model", model))
        if groups is None:
            return model, None
        if scratch is None:
            raise ValueError("reading a DeepSpeed optimizer needs a scratch folder")
        universal = convert_deepspeed(ckpt, scratch)
        return model, _read_universal(universal, groups, model, ckpt)

    def load_full_state(self, accelerator: Any, model: Any, optimizer: Any, full: dict[str, Any],
                        optim: dict[str, Any], *, adapter_only: bool) -> None:
        """The engine holds its own optimizer partitions: the fp32 masters and Adam moments through deepspeed.utils'
        safe_set_full_* (each rank keeps its partition), the module's own (low-precision) weights from the same
        values, the base optimizer's step counts and the param groups' hyperparameters (lr included) from the
        checkpoint. ``adapter_only`` changes nothing here: only the trainable parameters are required."""
        _load_deepspeed(model, optimizer, full, optim, accelerator.unwrap_model(model))

    def full_state_dict(self, accelerator: Any, model: Any) -> dict[str, Any] | None:
        """ZeRO-3 needs ``stage3_gather_16bit_weights_on_model_save``, which the generated config always sets; a
        16-bit engine exports its fp32 masters (:func:`_with_fp32_masters`)."""
        state_dict = accelerator.get_state_dict(model)
        if _engine_half(model):
            return _with_fp32_masters(accelerator, model, state_dict)
        return state_dict

    def frozen_copy(self, accelerator: Any, model: Any) -> tuple[Any, Callable[[], Any]]:
        """ZeRO-3: :class:`FrozenShards` of the engine (each rank holds 1/world of the copy); ZeRO-1/2: a deep copy."""
        if not self.shards_parameters:
            return super().frozen_copy(accelerator, model)
        return model, FrozenShards(model, deepspeed=True).swapped

    @property
    def shards_frozen_module(self) -> bool:
        """ZeRO-3 partitions a frozen module as the model; ZeRO-1/2 keep it whole (:meth:`frozen_module`)."""
        return self.shards_parameters

    def frozen_module(self, accelerator: Any, module: Any, cfg: RecipeConfig, model: Any) -> tuple[Any, bool]:
        """ZeRO-3: an engine of its own without an optimizer (the run's DeepSpeed config, its ZeRO-3 partitioning
        and precision), so each rank holds 1/world of it and a forward gathers what it computes with, as the model's
        engine does. ZeRO-1/2: whole on every rank, as the model is."""
        if not self.shards_frozen_module:
            return super().frozen_module(accelerator, module, cfg, model)
        import deepspeed  # lazy: heavy

        config = deepspeed_config(cfg, self)
        config["zero_optimization"]["offload_optimizer"] = {"device": "none"}
        with quiet():
            engine, *_ = deepspeed.initialize(model=module, config=config)
        engine.eval()
        return engine, True

    @contextlib.contextmanager
    def model_init(self, accelerator: Any, from_config: bool) -> Iterator[None]:
        """Under ZeRO-3 accelerate tells transformers to construct models inside ``deepspeed.zero.Init``
        (partitioned at birth: right for large pretrained weights), but a model initialized from a config there
        draws different random weights than on one process. Config-built models are therefore built normally and
        partitioned when the engine starts, so every backend starts from the same weights."""
        if not (from_config and self.zero_stage == 3):
            yield
            return
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # lazy: heavy

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            accelerator.state.deepspeed_plugin.set_deepspeed_weakref()

    def effective(self, cfg: RecipeConfig, row: SupportedModel, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"deepspeed_config": deepspeed_config(cfg, self)}

    def process_group_kwargs(self, cfg: RecipeConfig, on_cpu: bool) -> dict[str, Any]:
        """gloo on a CPU-only machine."""
        return {**super().process_group_kwargs(cfg, on_cpu), **({"backend": "gloo"} if on_cpu else {})}

    def accelerator_kwargs(self, cfg: RecipeConfig, row: SupportedModel, on_cpu: bool,
                           group: dict[str, Any]) -> dict[str, Any]:
        from accelerate.utils import DeepSpeedPlugin  # lazy: heavy

        if on_cpu and cfg.train.mixed_precision == "fp16":
            raise ConfigError("train.mixed_precision: DeepSpeed on CPU does not support fp16; use bf16 or no")
        # The launcher's ZeRO settings are already in our generated config (read by detect()); accelerate would
        # refuse a full config next to them, so mark them consumed.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        plugin = DeepSpeedPlugin(
            hf_ds_config=deepspeed_config(cfg, self, pin_memory=not on_cpu),
            gradient_accumulation_steps=cfg.grad_accum,
            gradient_clipping=cfg.train.max_grad_norm or 0.0, zero_stage=self.zero_stage,
            offload_optimizer_device=self.offload_optimizer, offload_param_device=self.offload_param,
            zero3_save_16bit_model=True, zero3_init_flag=False,
        )
        setup.start_process_group(group, cpu=False)  # not cpu=True: that silently turns DeepSpeed into DDP
        return {"mixed_precision": "no", "gradient_accumulation_steps": cfg.grad_accum, "deepspeed_plugin": plugin}

    def split_over(self, world: int, num_machines: int) -> Sharding:
        """ZeRO-1 the optimizer states (and master weights); ZeRO-2 also the gradients; ZeRO-3 also the parameters.
        ``offload_optimizer`` moves the optimizer states to host memory, ``offload_param`` (ZeRO-3) the
        parameters."""
        stage = self.zero_stage
        off_opt = self.offloads_optimizer
        off_param = stage == 3 and self.offload_param != "none"
        what = {1: "optimizer states", 2: "optimizer states and gradients",
                3: "parameters, gradients and optimizer states"}.get(stage, "nothing")
        offload = [w for w, on in (("optimizer states", off_opt), ("parameters", off_param)) if on]
        return Sharding(self.name, self.kind, world, world if stage >= 3 else 1, world if stage >= 2 else 1,
                        world if stage >= 1 else 1, params_on_host=off_param, optimizer_on_host=off_opt,
                        gathers=stage >= 3, zero_stage=stage, engine=self,
                        description=f"DeepSpeed ZeRO-{stage}: {what} / {world}"
                        + (f"; {' and '.join(offload)} offloaded to CPU memory" if offload else ""))

    @property
    def persistence_threshold(self) -> int:
        return ZERO3_PERSISTENCE_THRESHOLD

    @property
    def has_reduce_bucket(self) -> bool:
        return True

    def holds_master_copy(self, engine_half: bool) -> bool:
        """ZeRO-1/2 always; ZeRO-3 in fp32 on the device steps on its own flat params."""
        return self.zero_stage in (1, 2) or engine_half or self.offloads_optimizer


def deepspeed_config(cfg: RecipeConfig, backend: DeepSpeed, pin_memory: bool = False) -> dict[str, Any]:
    """The DeepSpeed config, generated from the recipe so batch sizes, accumulation and clipping always agree."""
    offload: dict[str, Any] = {"device": backend.offload_optimizer}
    if backend.offloads_optimizer:
        offload["pin_memory"] = pin_memory
    return {
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.train.max_grad_norm or 0.0,
        # skip a step whose gradients are not finite (fp32 does this through its grad norm, fp16 through its scaler)
        "bf16": {"enabled": cfg.train.mixed_precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": cfg.train.mixed_precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {
            "stage": backend.zero_stage,
            "offload_optimizer": offload,
            "offload_param": {"device": backend.offload_param},
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        # our optimizer is torch AdamW/SGD (also with offload: the CPU step runs torch's AdamW, same numerics)
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 62,
        "wall_clock_breakdown": False,
    }


def reduce_bucket_elements(trainable_numel: int) -> int:
    """DeepSpeed's gradient-reduction bucket for a model with ``trainable_numel`` trainable elements: its default,
    capped at the gradients there are (at least 1). DeepSpeed allocates the bucket whole, whatever the model's size
    (ZeRO-1/2 at every backward, ZeRO-3 once for the run): 5e8 elements, 1 GB in bf16 and 2 GB in fp32, for a model
    whose gradients may be far smaller; a bucket bigger than every gradient together is never filled."""
    return max(1, min(DEEPSPEED_REDUCE_BUCKET, trainable_numel))


def size_deepspeed_buckets(accelerator: Any, model: Any) -> None:
    """Before ``accelerator.prepare``: set the DeepSpeed config's ``reduce_bucket_size`` to
    :func:`reduce_bucket_elements` of ``model`` (whole sizes: ZeRO-3 builds partitioned), as ``finetune plan``
    counts it. Nothing for other backends."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    trainable = sum(setup.full_numel(p) for p in model.parameters() if p.requires_grad)
    plugin.deepspeed_config.setdefault("zero_optimization", {})["reduce_bucket_size"] = \
        reduce_bucket_elements(trainable)


def _engine_half(engine: Any) -> bool:
    """Whether a DeepSpeed engine runs bf16/fp16 (it then holds the model in 16 bits, the fp32 masters apart)."""
    return any(bool(getattr(engine, name, lambda: False)()) for name in ("bfloat16_enabled", "fp16_enabled"))


def _with_fp32_masters(accelerator: Any, engine: Any, state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
    """``state_dict`` (the engine's 16-bit module weights) with every trainable parameter replaced by DeepSpeed's
    fp32 master copy, the weights the optimizer really updated, and the rest in fp32 too (frozen weights were cast
    to 16 bits by the engine: their fp32 value is exactly that). Without it a bf16 DeepSpeed run exported its
    weights rounded to bf16 (8 significant bits), unlike every other backend, which exports its fp32 masters.
    ``safe_get_full_fp32_param`` is a collective under ZeRO (it gathers the partitions): every rank calls it, in
    the same parameter order."""
    import torch  # lazy: heavy
    from deepspeed.utils import safe_get_full_fp32_param  # lazy: heavy

    masters: dict[str, Any] = {}
    seen: dict[int, Any] = {}
    for name, param in accelerator.unwrap_model(engine).named_parameters(remove_duplicate=False):
        if param.requires_grad and id(param) not in seen:
            seen[id(param)] = safe_get_full_fp32_param(param)
        if seen.get(id(param)) is not None:
            masters[name] = seen[id(param)]
    if not state_dict:
        return state_dict
    return {key: (masters[key].detach().to("cpu", torch.float32).reshape(value.shape) if key in masters
                  else value.float() if torch.is_tensor(value) and value.is_floating_point() else value)
            for key, value in state_dict.items()}


# --- a checkpoint read as one full state (one process, no process group) --------------------------------------------


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
    with quiet():
        from deepspeed.checkpoint import ds_to_universal  # lazy: heavy

        args = Namespace(input_folder=str(ckpt / "pytorch_model"), output_folder=str(out), num_extract_workers=1,
                         num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        ds_to_universal.main(args)  # (its own temporary files stay inside the scratch, which is removed whole)
    done.write_text(json.dumps({"source": source}), encoding="utf-8")
    return out


def _universal_tensor(path: Path) -> Any:
    """One tensor file of a universal checkpoint: the tensor itself, or a record holding it under ``param``."""
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


# --- a full state loaded into the engine (every rank) ---------------------------------------------------------------


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
    saved = live_groups(optim, base)
    names = {clean_name(n): p for n, p in unwrapped.named_parameters()}
    unexpected = sorted(k for k in full if k not in names and k not in dict(unwrapped.named_buffers()))
    check_keys([], unexpected, set(), "model")
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
