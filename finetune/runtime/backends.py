"""The Accelerator for a recipe, set up for the backend the launcher chose. All backend knowledge lives here.

``accelerate launch --config_file accelerate_configs/<x>.yaml`` exports the config as environment variables
(ACCELERATE_USE_FSDP, FSDP_VERSION, ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE, ...); that
environment is the single source of truth for which backend runs, also under a launcher the user started.
On top of it this module supplies what the recipe and the SupportedModel row know:

- FSDP: the decoder-layer class to wrap (from the row), ``use_orig_params`` (our optimizer groups see real
  parameters), sharded state dicts for checkpoints, and no ``sync_module_states`` (every rank builds the same
  weights from the same seed; the option raises on CPU). Pretrained weights are read by rank 0 alone and sent to
  the others as :attr:`Backend.weight_distribution` says (finetune.runtime.materialize; FSDP2:
  :func:`shard_from_rank0`).
- DeepSpeed: the whole DeepSpeed config generated from the recipe (global/micro batch, accumulation, clipping,
  precision, ZeRO stage and offload), so the two can never disagree.
- CPU-only machines (docs/platform-notes.md): DDP needs ``Accelerator(cpu=True)`` (gloo); DeepSpeed needs a gloo
  process group and must NOT get ``cpu=True`` (it would silently run DDP); FSDP needs the shared PartialState marked
  as a multi-device run before the Accelerator exists, else accelerate silently falls back to DDP.

Mixed precision stays ours (finetune.runtime.precision) except under DeepSpeed, whose engine owns it, and FSDP, whose
mixed-precision policy casts the weights (autocast off; our grad scaler still runs fp16).
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from finetune.config import RecipeConfig, accelerate
from finetune.errors import ConfigError
from finetune.registry import SupportedModel


@dataclass(frozen=True)
class Backend:
    """Which backend runs, as the launcher's environment says."""

    kind: str  # "single" | "ddp" | "fsdp" | "deepspeed"
    fsdp_version: int | None = None
    zero_stage: int | None = None
    offload_optimizer: str = "none"
    offload_param: str = "none"
    # FSDP with gradient accumulation: keep whole (unsharded) fp32 gradients across the window's micro-steps and
    # reduce-scatter once at its end (less traffic, one model's worth of gradients per rank), instead of reducing
    # each micro-batch into the sharded gradients. Set only where finetune.runtime.plan says those gradients fit
    # (the worker asks it: ``worker.fsdp_accumulation``). See :attr:`syncs_each_micro_step`.
    keep_unsharded_grads: bool = False

    @property
    def name(self) -> str:
        """ddp, fsdp1, fsdp2, zero1..3 (+ _offload), or single."""
        if self.kind == "fsdp":
            return f"fsdp{self.fsdp_version}"
        if self.kind == "deepspeed":
            return f"zero{self.zero_stage}" + ("_offload" if self.offload_optimizer != "none" else "")
        return self.kind

    @property
    def engine_owns_precision(self) -> bool:
        """DeepSpeed casts the model and scales the loss itself."""
        return self.kind == "deepspeed"

    @property
    def casts_parameters(self) -> bool:
        """FSDP casts the weights itself for bf16/fp16 (FSDP2 ``MixedPrecisionPolicy``, FSDP1 ``MixedPrecision``:
        16-bit copies for the forward/backward, fp32 gradient reduction, fp32 sharded master weights), so autocast
        must stay off: casting twice would only cost time. Our grad scaler still runs fp16 (:attr:`sharded_scaler`)."""
        return self.kind == "fsdp"

    @property
    def keeps_fp32_master_weights(self) -> bool:
        """The optimizer updates fp32 master weights whatever ``model.dtype`` is: DeepSpeed's bf16/fp16 optimizer
        keeps an fp32 partition of its own. Everywhere else the optimizer updates the weights in their own dtype."""
        return self.engine_owns_precision

    @property
    def sharded_scaler(self) -> bool:
        """fp16 needs torch's ShardedGradScaler: FSDP1's flat gradient shards differ per rank, so an overflow found
        on one rank must skip the step on all (FSDP2's DTensor gradients already all-reduce the plain scaler's
        overflow check)."""
        return self.kind == "fsdp" and self.fsdp_version == 1

    @property
    def syncs_each_micro_step(self) -> bool:
        """Gradients are reduced on every micro-step, not only the window's last (accelerate's ``sync_each_batch``):
        under FSDP (as torchtitan does) each micro-batch's gradients are reduce-scattered into the fp32 sharded
        gradients, so no rank holds whole unsharded gradients across micro-steps, unless
        :attr:`keep_unsharded_grads` says they fit. The sum is the same: the loop divides every micro-step by the
        window's tokens, and reduction is linear."""
        return self.kind == "fsdp" and not self.keep_unsharded_grads

    @property
    def shards_parameters(self) -> bool:
        """Parameters are gathered inside forward: every rank must run the same number of forward passes."""
        return self.kind == "fsdp" or (self.kind == "deepspeed" and (self.zero_stage or 0) >= 3)

    @property
    def weight_distribution(self) -> str:
        """How the ranks but 0 get pretrained weights when several processes load ``model.path``
        (finetune.runtime.materialize; docs/platform-notes.md):

        - ``broadcast`` (DDP, ZeRO-1/2, FSDP1): built empty, then every parameter and buffer is received from rank 0
          (these ranks hold the whole model anyway: DDP and ZeRO-1/2 train on it, FSDP1 shards it only when it wraps).
        - ``shard`` (FSDP2): built empty; buffers come from rank 0, and accelerate's ``cpu_ram_efficient_loading``
          moves the model to the meta device, shards it and sends each rank only its shards of rank 0's weights.
        - ``library`` (ZeRO-3): transformers constructs the model inside ``deepspeed.zero.Init`` (partitioned at
          birth) and only rank 0 reads tensor data; the others read the shapes. Nothing to add.
        - ``everywhere`` (one process): it reads them itself.
        """
        if self.kind == "deepspeed":
            return "library" if self.zero_stage == 3 else "broadcast"
        if self.kind == "fsdp":
            return "shard" if self.fsdp_version == 2 else "broadcast"
        return "broadcast" if self.kind == "ddp" else "everywhere"

    @property
    def generates_unwrapped(self) -> bool:
        """transformers' ``generate`` can run on the unwrapped module (vision-language exact_match needs it): not
        under FSDP1, whose wrapped modules hold flat-sharded parameters outside the wrapper's own forward."""
        return not (self.kind == "fsdp" and self.fsdp_version == 1)

    @property
    def rank_bound_state(self) -> bool:
        """Checkpoints hold per-rank shards (ZeRO partitions, FSDP sharded state): the native load needs the same world
        size (finetune.artifacts.portable resumes them elsewhere)."""
        return self.kind in ("deepspeed", "fsdp")

    def resume_problem(self, saved_by: str, saved_world: int, world: int) -> str | None:
        """Why this backend on ``world`` processes cannot load a checkpoint written by backend ``saved_by`` on
        ``saved_world`` processes in its NATIVE format, or None when it can (then resume loads it natively, bit for
        bit). Single and DDP checkpoints hold whole tensors, so they move between each other and any world size; a
        sharded backend reads only its own format, and only on the world size that wrote it (per-rank shards).
        Any other pair resumes through the portable state (finetune.artifacts.portable) when the checkpoint allows
        it."""
        if self.loads_natively(saved_by, saved_world, world):
            return None
        if saved_by in ("single", "ddp"):
            config = launcher_config_name(backend_named(saved_by))
            return (f"was written by {saved_world} process(es) under {saved_by} (whole tensors); its own format "
                    f"loads only under single or ddp (--num-processes {saved_world} and --accelerate-config {config}, "
                    "or any --num-processes with --accelerate-config ddp)")
        return (f"was written by {saved_world} process(es) under {saved_by} ({sharding(saved_by)}); its own format "
                f"loads only with --num-processes {saved_world} and --accelerate-config {saved_by}")

    def loads_natively(self, saved_by: str, saved_world: int, world: int) -> bool:
        """Whether the backend's own load reads this checkpoint (see :meth:`resume_problem`)."""
        same_format = {saved_by, self.name} <= {"single", "ddp"} or saved_by == self.name
        return same_format and not (self.rank_bound_state and saved_world != world)


_SHARDING = {"single": "whole tensors", "ddp": "whole tensors", "fsdp1": "FSDP1 flat-parameter shards (DCP)",
             "fsdp2": "FSDP2 DTensor shards (DCP)", "zero1": "ZeRO-1 optimizer partitions",
             "zero2": "ZeRO-2 optimizer and gradient partitions", "zero3": "ZeRO-3 partitions",
             "zero3_offload": "ZeRO-3 partitions, optimizer on CPU"}
_FORMAT = {"single": "model.safetensors + optimizer.bin", "ddp": "model.safetensors + optimizer.bin",
           "fsdp1": "torch.distributed.checkpoint pytorch_model_fsdp_0/ + fsdp1_optimizer",
           "fsdp2": "torch.distributed.checkpoint pytorch_model_fsdp_0/ + optimizer_0/",
           **{f"zero{s}{o}": "DeepSpeed pytorch_model/ (mp_rank_00_model_states.pt + zero_pp_rank_*_optim_states.pt)"
              for s in (1, 2, 3) for o in ("", "_offload")}}


def backend_named(name: str) -> Backend:
    """The Backend a checkpoint manifest names (``single``, ``ddp``, ``fsdp1``, ``zero3_offload``, ...); a
    ValueError for a name no finetune backend has."""
    if name in ("single", "ddp"):
        return Backend(name)
    if name in ("fsdp1", "fsdp2"):
        return Backend("fsdp", fsdp_version=int(name[-1]))
    stage, _, offload = name.removeprefix("zero").partition("_")
    if name.startswith("zero") and stage in ("1", "2", "3") and offload in ("", "offload"):
        return Backend("deepspeed", zero_stage=int(stage), offload_optimizer="cpu" if offload else "none")
    raise ValueError(f"unknown backend {name!r}")


def sharding(name: str) -> str:
    """How a checkpoint of backend ``name`` splits the model and optimizer state (for manifests and messages)."""
    return _SHARDING.get(name, "unknown")


def layout(name: str, world_size: int) -> dict[str, Any]:
    """The ``layout`` record of a checkpoint manifest: which backend on how many processes wrote it, how its state
    is split and in which files."""
    return {"backend": name, "world_size": world_size, "sharding": sharding(name),
            "format": _FORMAT.get(name, "unknown")}


def launcher_config_name(backend: Backend) -> str:
    """The accelerate_configs/ name that matches what a launcher started (recorded in the resolved recipe)."""
    return "cpu" if backend.kind == "single" else backend.name


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def detect(env: Mapping[str, str] | None = None) -> Backend:
    """The backend the launcher's environment selects (single process when there is no launcher)."""
    env = os.environ if env is None else env
    if _true(env.get("ACCELERATE_USE_DEEPSPEED")):
        return Backend("deepspeed", zero_stage=int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
                       offload_optimizer=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none").lower(),
                       offload_param=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none").lower())
    if _true(env.get("ACCELERATE_USE_FSDP")):
        return Backend("fsdp", fsdp_version=int(env.get("FSDP_VERSION", "1")))
    if int(env.get("WORLD_SIZE", "1")) > 1:
        return Backend("ddp")
    return Backend("single")


def from_accelerate_config(data: Mapping[str, Any]) -> Backend:
    """The backend an accelerate config file's settings select (for --dry-run, before anything is launched)."""
    kind = accelerate.distributed_type(data)
    if kind == "DEEPSPEED":
        ds = data.get("deepspeed_config") or {}
        return Backend("deepspeed", zero_stage=int(ds.get("zero_stage", 2)),
                       offload_optimizer=str(ds.get("offload_optimizer_device", "none")).lower(),
                       offload_param=str(ds.get("offload_param_device", "none")).lower())
    if kind == "FSDP":
        return Backend("fsdp", fsdp_version=int((data.get("fsdp_config") or {}).get("fsdp_version", 1)))
    return Backend("single") if kind == "NO" else Backend("ddp")


@dataclass(frozen=True)
class AccelerateConfig:
    """An accelerate config as a launch will use it: its file and settings, and the Backend they select."""

    file: accelerate.AccelerateFile
    backend: Backend

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def settings(self) -> dict[str, Any]:
        return self.file.settings

    @property
    def machines(self) -> int:
        """How many machines it spans (``num_machines``; one when it does not say)."""
        machines = self.settings.get("num_machines")
        return machines if isinstance(machines, int) and not isinstance(machines, bool) and machines > 1 else 1

    @property
    def names_port(self) -> bool:
        """Whether it sets the rendezvous port itself (``main_process_port``)."""
        return "main_process_port" in self.settings


def accelerate_config(name: str, key: str = accelerate.RECIPE_KEY) -> AccelerateConfig:
    """The accelerate config ``name`` (a path or a shipped name) that ``finetune run``, ``plan``, ``generate`` and a
    launch use, read once (finetune.config.accelerate: a missing, unreadable or invalid file is one ConfigError line
    starting with ``key``, the setting as the command spells it) and interpreted here."""
    file = accelerate.load(name, key)
    return AccelerateConfig(file, from_accelerate_config(file.settings))


def effective_settings(cfg: RecipeConfig, row: SupportedModel, data: Mapping[str, Any]) -> dict[str, Any]:
    """What the worker will set up for this recipe and accelerate config (printed by --dry-run)."""
    backend = from_accelerate_config(data)
    out: dict[str, Any] = {"backend": backend.name}
    if backend.kind == "fsdp":
        half = {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.train.mixed_precision)
        out["fsdp"] = {**(data.get("fsdp_config") or {}), "transformer_cls_names_to_wrap": list(row.wrap_classes),
                       "use_orig_params": True, "sync_module_states": False,
                       "mixed_precision_policy": {"param_dtype": half, "reduce_dtype": "float32"} if half else None,
                       "reduce_each_micro_step": backend.syncs_each_micro_step and cfg.grad_accum > 1}
    if backend.kind == "deepspeed":
        out["deepspeed_config"] = deepspeed_config(cfg, backend)
    return out


def deepspeed_config(cfg: RecipeConfig, backend: Backend, pin_memory: bool = False) -> dict[str, Any]:
    """The DeepSpeed config, generated from the recipe so batch sizes, accumulation and clipping always agree."""
    offload: dict[str, Any] = {"device": backend.offload_optimizer}
    if backend.offload_optimizer != "none":
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


DEEPSPEED_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)


def reduce_bucket_elements(trainable_numel: int) -> int:
    """DeepSpeed's gradient-reduction bucket for a model with ``trainable_numel`` trainable elements: its default,
    capped at the gradients there are (at least 1). DeepSpeed allocates the bucket whole, whatever the model's size
    (ZeRO-1/2 at every backward, ZeRO-3 once for the run): 5e8 elements, 1 GB in bf16 and 2 GB in fp32, for a model
    whose gradients may be far smaller; a bucket bigger than every gradient together is never filled."""
    return max(1, min(DEEPSPEED_REDUCE_BUCKET, trainable_numel))


def settle(accelerator: Any) -> None:
    """Every rank, once its run has finished and before the process group is torn down: a barrier (so no rank is
    still inside a collective), then half a second without the GIL, so gloo's threads can free the work of the last
    collectives. Freeing a collective's tensors needs the GIL, and the process group's destructor joins those
    threads while holding it: a rank that got there while its last collective was still being freed hung for ever
    in ``~ProcessGroupGloo`` (seen in 2-process resumes, once rank 0 spent longer at the end writing the summary)."""

    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        time.sleep(0.5)  # releases the GIL


def size_deepspeed_buckets(accelerator: Any, model: Any) -> None:
    """Before ``accelerator.prepare``: set the DeepSpeed config's ``reduce_bucket_size`` to
    :func:`reduce_bucket_elements` of ``model`` (whole sizes: ZeRO-3 builds partitioned), as ``finetune plan``
    counts it. Nothing for other backends."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    plugin.deepspeed_config.setdefault("zero_optimization", {})["reduce_bucket_size"] = \
        reduce_bucket_elements(trainable)


def fsdp_mixed_precision(mixed_precision: str, fsdp_version: int) -> Any | None:
    """FSDP's own mixed precision for ``train.mixed_precision`` (None for ``no``): compute on bf16/fp16 copies of
    the weights, reduce gradients in fp32, keep the sharded master weights (and so the optimizer) in their fp32.
    Buffers (rotary frequencies) keep their dtype, as under autocast. FSDP2: ``MixedPrecisionPolicy``; FSDP1:
    ``MixedPrecision`` (its gradients come back in fp32: ``keep_low_precision_grads`` stays off)."""
    import torch  # lazy: heavy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    if dtype is None:
        return None
    if fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy  # lazy: heavy

        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    from torch.distributed.fsdp import MixedPrecision  # lazy: heavy

    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=None)


def _mark_cpu_run_as_multi_device(group: dict[str, Any]) -> None:
    """FSDP on CPU (docs/platform-notes.md): accelerate only builds FSDP for a multi-device state, so create the
    shared PartialState on the CPU (``group``: :func:`process_group_kwargs`) and mark it as one before the
    Accelerator reads it."""
    import torch  # lazy: heavy
    from accelerate.utils import DistributedType  # lazy: heavy

    state = _start_process_group(group, cpu=True)
    state.distributed_type = DistributedType.MULTI_GPU
    state.device = torch.device("cpu")


def _unwrap_without_importing_deepspeed() -> None:
    """Keep a backend that is not DeepSpeed from importing DeepSpeed.

    accelerate's ``unwrap_model`` (behind ``get_state_dict``, checkpoint and export saves, peft's adapter hooks)
    imports deepspeed whenever the package is installed, only to ask ``isinstance(model, DeepSpeedEngine)``. That
    import costs seconds and prints "Setting accelerator to CPU" on stdout. A model can only be a DeepSpeedEngine
    once deepspeed has been imported, so accelerate's "is deepspeed installed?" is narrowed, for that check only,
    to "is deepspeed imported?": the same answer, without the import. DeepSpeed backends import it themselves.
    """

    from accelerate.utils import other  # lazy: heavy

    current = getattr(other, "is_deepspeed_available", None)
    if current is not None and current.__name__ != "_deepspeed_imported":  # (a newer accelerate may not have it)

        def _deepspeed_imported() -> bool:
            return "deepspeed" in sys.modules

        other.is_deepspeed_available = _deepspeed_imported


def make_accelerator(cfg: RecipeConfig, row: SupportedModel, backend: Backend | None = None) -> tuple[Any, Backend]:
    """An Accelerator for this rank, and the backend it runs.

    ``gradient_accumulation_steps`` is the recipe's: the loop uses ``accelerator.accumulate`` so every backend
    (DeepSpeed included) knows which micro-step ends a window; whether gradients are also reduced on the other
    micro-steps is :attr:`Backend.syncs_each_micro_step`. Precision stays ``no`` for accelerate: autocast and the
    scaler are ours (finetune.runtime.precision), and FSDP gets its own policy (:func:`fsdp_mixed_precision`).
    """
    import torch  # lazy: heavy
    from accelerate import Accelerator  # lazy: heavy
    from accelerate.utils import (
        DeepSpeedPlugin,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
    )  # lazy: heavy

    backend = backend or detect()
    on_cpu = not torch.cuda.is_available()
    group = process_group_kwargs(cfg, backend, on_cpu)
    kwargs: dict[str, Any] = {"mixed_precision": "no", "gradient_accumulation_steps": cfg.grad_accum}
    if backend.kind == "deepspeed":
        if on_cpu and cfg.train.mixed_precision == "fp16":
            raise ConfigError("train.mixed_precision: DeepSpeed on CPU does not support fp16; use bf16 or no")
        # The launcher's ZeRO settings are already in our generated config (read by detect()); accelerate would
        # refuse a full config next to them, so mark them consumed.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            hf_ds_config=deepspeed_config(cfg, backend, pin_memory=not on_cpu),
            gradient_accumulation_steps=cfg.grad_accum,
            gradient_clipping=cfg.train.max_grad_norm or 0.0, zero_stage=backend.zero_stage,
            offload_optimizer_device=backend.offload_optimizer, offload_param_device=backend.offload_param,
            zero3_save_16bit_model=True, zero3_init_flag=False,
        )
        _start_process_group(group, cpu=False)  # not cpu=True: that silently turns DeepSpeed into DDP
        return Accelerator(**kwargs), backend
    _unwrap_without_importing_deepspeed()
    if backend.kind == "fsdp":
        from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig  # lazy: heavy

        if on_cpu:
            _mark_cpu_run_as_multi_device(group)
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=backend.fsdp_version, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=list(row.wrap_classes), use_orig_params=True, sync_module_states=False,
            state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False,
            mixed_precision_policy=fsdp_mixed_precision(cfg.train.mixed_precision, backend.fsdp_version or 1),
            # accelerate's default offload_to_cpu=True is meant for GPUs; on a CPU run it is a copy at best
            state_dict_config=ShardedStateDictConfig(offload_to_cpu=not on_cpu),
            optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=not on_cpu),
        )
    if backend.syncs_each_micro_step:
        kwargs["gradient_accumulation_plugin"] = GradientAccumulationPlugin(
            num_steps=kwargs.pop("gradient_accumulation_steps"), sync_each_batch=True)
    _start_process_group(group, cpu=on_cpu)  # FSDP on CPU: already started, marked as multi-device
    return Accelerator(cpu=on_cpu, **kwargs), backend


def process_group_kwargs(cfg: RecipeConfig, backend: Backend, on_cpu: bool) -> dict[str, Any]:
    """``init_process_group``'s keywords for this run: ``launch.timeout_minutes`` as the collective timeout on every
    backend (NCCL's default is 10 minutes, gloo's 30), and gloo for DeepSpeed on a CPU-only machine."""

    kwargs: dict[str, Any] = {"timeout": timedelta(minutes=cfg.launch.timeout_minutes)}
    if backend.kind == "deepspeed" and on_cpu:
        kwargs["backend"] = "gloo"
    return kwargs


def _start_process_group(kwargs: dict[str, Any], cpu: bool) -> Any:
    """accelerate's shared PartialState, which creates the process group (DeepSpeed: ``deepspeed.init_distributed``)
    with ``kwargs`` passed as they are; the Accelerator created next adopts it. Not through accelerate's
    ``InitProcessGroupKwargs``: it passes on only the fields that differ from its NCCL defaults, so a 10-minute
    timeout was dropped (gloo then waited 30), and a PartialState created before it (FSDP on CPU) ignores it."""
    from accelerate import PartialState  # lazy: heavy

    return PartialState(cpu=cpu, **kwargs)


def shard_from_rank0(accelerator: Any, enabled: bool) -> None:
    """FSDP2: whether ``accelerator.prepare`` distributes rank 0's weights into every rank's shards (accelerate's
    ``cpu_ram_efficient_loading``: the model goes to the meta device, is sharded there, then each parameter is
    broadcast from rank 0 and each rank keeps its shard). Set after the model is built, because whether the model
    allows it (finetune.runtime.materialize) is known only then. The flag is read only when the model is prepared; it is
    set on the plugin, not in the environment, where it would also change how transformers loads models."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or plugin.fsdp_version != 2:
        raise RuntimeError("shard_from_rank0 applies to FSDP2 only")
    plugin.cpu_ram_efficient_loading = enabled


@contextlib.contextmanager
def model_init(accelerator: Any, backend: Backend, from_config: bool) -> Iterator[None]:
    """Build the model in here. Under ZeRO-3 accelerate tells transformers to construct models inside
    ``deepspeed.zero.Init`` (partitioned at birth: right for large pretrained weights), but a model initialized
    from a config there draws different random weights than on one process. Config-built models are therefore
    built normally and partitioned when the engine starts, so every backend starts from the same weights."""
    if not (from_config and backend.kind == "deepspeed" and backend.zero_stage == 3):
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # lazy: heavy

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


class FSDP1OptimizerState:
    """FSDP1 with ``use_orig_params``: accelerate's sharded optimizer save/load restores NOTHING (the optimizer
    state is empty after ``load_state``, so a resumed Adam restarts its moments). This object checkpoints the
    optimizer state once more, gathered whole with torch.distributed.checkpoint.state_dict (saved as JSON +
    safetensors by finetune.artifacts.checkpoint), and loads it back after accelerate's no-op; ``tests/distributed``
    proves resume bit-identical with it."""

    holds_optimizer_state = True  # a portable resume loads the optimizer itself (finetune.artifacts.checkpoint.load)

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, getattr(optimizer, "optimizer", optimizer)

    def _options(self) -> Any:
        import torch  # lazy: heavy
        from torch.distributed.checkpoint.state_dict import StateDictOptions  # lazy: heavy

        return StateDictOptions(full_state_dict=True, cpu_offload=torch.cuda.is_available())

    def state_dict(self) -> dict[str, Any]:
        """Collective: called on every rank by ``save_state``."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # lazy: heavy

        return get_optimizer_state_dict(self.model, self.optimizer, options=self._options())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict  # lazy: heavy

        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state, options=self._options())


def extra_checkpoint_state(backend: Backend, model: Any, optimizer: Any) -> dict[str, Any]:
    """Objects to checkpoint (by name) on top of what accelerate saves for this backend."""
    if backend.kind == "fsdp" and backend.fsdp_version == 1:
        return {"fsdp1_optimizer": FSDP1OptimizerState(model, optimizer)}
    return {}


# What a torch.distributed.checkpoint ``.metadata`` pickle may construct: DCP's own metadata records, torch.Size,
# dtypes, layouts and paths. Nothing else: a planted payload fails to load instead of running.
_DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


def restrict_checkpoint_loading(backend: Backend) -> None:
    """Data-only loading of the backend's own checkpoint format, on top of ``weights_only`` for every ``torch.load``
    (finetune.artifacts.checkpoint.forbid_unpickling). FSDP: DCP's ``.metadata`` pickle goes through
    :func:`restrict_dcp_metadata`. DeepSpeed: its optimizer files hold its ZeRO stage enum, its loss scaler's
    settings and fragment addresses, data classes that run no code when rebuilt: they are allowed. (Each is set up
    only for its own backend: importing torch.distributed.checkpoint alone costs half a second.)"""
    if backend.kind == "fsdp":
        restrict_dcp_metadata()
    if backend.kind != "deepspeed":
        return
    import torch  # lazy: heavy
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # lazy: heavy
    from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: heavy
    from deepspeed.utils.tensor_fragment import fragment_address  # lazy: heavy

    torch.serialization.add_safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address])


def restrict_dcp_metadata() -> None:
    """torch.distributed.checkpoint (FSDP's sharded checkpoints) reads ``.metadata`` with a plain ``pickle.load``:
    make that module's ``pickle.load`` an unpickler that constructs only :data:`_DCP_METADATA_GLOBALS` and dtypes.
    (Its tensor and bytes records go through ``torch.load``, which ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` restricts.)"""

    import torch  # lazy: heavy
    import torch.distributed.checkpoint.filesystem as dcp_fs  # lazy: heavy

    if getattr(dcp_fs.pickle, "restricted", False):
        return

    class MetadataUnpickler(pickle.Unpickler):  # safe: find_class allows only the names above
        def find_class(self, module: str, name: str) -> Any:
            dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            if (module, name) not in _DCP_METADATA_GLOBALS and not dtype:
                raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")  # safe
            return super().find_class(module, name)

    dcp_fs.pickle = types.SimpleNamespace(  # type: ignore[attr-defined]
        load=lambda file, **_: MetadataUnpickler(file).load(), dump=pickle.dump, restricted=True)  # safe: restricted


def export_module(accelerator: Any, model: Any, backend: Backend, state_dict: dict[str, Any] | None,
                  rebuild: Callable[[], Any] | None) -> Any:
    """The module whose ``save_pretrained(state_dict=...)`` writes the export, on rank 0: the unwrapped model.

    FSDP1 renames the modules it wraps (``_fsdp_wrapped_module``), so peft, which looks its adapter up by module
    name, finds none in the gathered state dict and saves an empty adapter. Under FSDP1 a PEFT model is therefore
    saved from a fresh unwrapped copy (``rebuild()``) loaded with the gathered weights."""
    unwrapped = accelerator.unwrap_model(model)
    if not (backend.kind == "fsdp" and backend.fsdp_version == 1 and hasattr(unwrapped, "peft_config")):
        return unwrapped
    if rebuild is None or state_dict is None:
        raise RuntimeError("an FSDP1 PEFT export needs a rebuild factory and the gathered state dict")
    saver = rebuild()
    saver.load_state_dict(state_dict)
    return saver


def full_state_dict(accelerator: Any, model: Any, backend: Backend) -> dict[str, Any] | None:
    """The whole model's state dict on rank 0 (None elsewhere may occur); a collective: call on every rank.

    FSDP1's default full-state-dict gather offloads to CPU and segfaults on a CPU-only run (docs/platform-notes.md),
    so it is gathered on the compute device (rank 0 only) there; ZeRO-3 needs
    ``stage3_gather_16bit_weights_on_model_save``, which the generated DeepSpeed config always sets.
    """
    if backend.kind == "fsdp" and backend.fsdp_version == 1:
        import torch  # lazy: heavy
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType  # lazy: heavy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # lazy: heavy

        config = FullStateDictConfig(offload_to_cpu=torch.cuda.is_available(), rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()
    state_dict = accelerator.get_state_dict(model)
    if backend.kind == "deepspeed" and _engine_half(model):
        return _with_fp32_masters(accelerator, model, state_dict)
    return state_dict


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


def full_shape(param: Any) -> tuple[int, ...]:
    """A parameter's whole, unpartitioned shape, whichever backend holds it: what every decision taken from a
    parameter's shape (optimizer groups, counts, LoRA targets, freezing) must read.

    ``param.shape`` is not it everywhere. ZeRO-3 builds a ``model.path`` model partitioned at birth
    (``deepspeed.zero.Init``): each parameter's ``.data`` is then an empty 1-D placeholder and its real shape is
    ``ds_shape``, so every matrix would look like a bias. An FSDP1 ``FlatParameter`` is 1-D by nature; its whole size
    is ``_unpadded_unsharded_size``. FSDP2's DTensor reports its global shape itself, as plain tensors do. (FSDP1's
    original parameters are sharded views only after ``accelerator.prepare``; finetune decides from shapes before.)"""
    for attribute in ("ds_shape", "_unpadded_unsharded_size"):  # ZeRO-3; FSDP1 flat parameter
        whole = getattr(param, attribute, None)
        if whole is not None:
            return tuple(int(n) for n in whole)
    return tuple(param.shape)


def full_numel(param: Any) -> int:
    """The number of elements of the whole parameter (:func:`full_shape`), not of this rank's partition."""
    count = 1
    for n in full_shape(param):
        count *= n
    return count


def frozen_copy(accelerator: Any, model: Any, backend: Backend) -> tuple[Any, Callable[[], Any]]:
    """A frozen copy of the prepared ``model``'s current weights, as (the module that scores with it, a factory of
    the context it scores in): for a reference that only runs forward passes (GRPO's KL term with full
    fine-tuning). Neither is registered with the accelerator or a checkpoint object, so the copy is never saved.

    - parameters not sharded (one process, DDP, ZeRO-1/2): a deep copy of the unwrapped module, no gradients, eval
      mode; it scores outside any context and runs no collective.
    - FSDP2 and ZeRO-3: :class:`FrozenShards`; the policy module itself scores, with this rank's shards of the
      copy swapped into its parameters inside the context, so the copy is sharded exactly as the policy (each rank
      holds 1/world of it) and its forward passes are the policy's own, in lockstep on every rank.
    - FSDP1: refused (recipe validation refuses it first): its flat parameters hold a rank's shards of several
      tensors at once, with views that FSDP re-points as it gathers; copying into them is not a supported write.
    """
    if not backend.shards_parameters:
        reference = copy.deepcopy(accelerator.unwrap_model(model)).requires_grad_(False).eval()
        return reference, contextlib.nullcontext
    if backend.kind == "fsdp" and backend.fsdp_version == 1:
        raise ConfigError("a frozen copy of the weights (grpo.beta > 0 with full fine-tuning) is not built under "
                          "FSDP1; use launch.accelerate_config=fsdp2 or zero3, peft (LoRA), or grpo.beta=0")
    shards = FrozenShards(model, deepspeed=backend.kind == "deepspeed")
    return model, shards.swapped


class FrozenShards:
    """This rank's shards of every parameter of a prepared FSDP2 module or ZeRO-3 engine, copied when built: a
    frozen copy of the weights at that moment, sharded as the model is. :meth:`swapped` puts them into the model's
    parameters and the live shards back afterwards, so a forward pass inside it gathers the copy's weights.

    Both backends gather a parameter from its local shard in each forward (FSDP2: the DTensor's local tensor, a view
    of the flat data it all-gathers; ZeRO-3: ``ds_tensor``), so every parameter is first released to its shard
    (FSDP2 ``reshard``; ZeRO-3 ``empty_partition_cache``, which also releases the parameters it keeps gathered
    between forwards): an unsharded copy left from an earlier forward would otherwise be used as it is."""

    def __init__(self, model: Any, *, deepspeed: bool) -> None:
        import torch  # lazy: heavy

        self.model, self.deepspeed = model, deepspeed
        module = model.module if deepspeed else model
        self.params = list(dict.fromkeys(module.parameters()))
        with torch.no_grad():
            self.saved = [shard.detach().clone() for shard in self._shards()]

    def _shards(self) -> list[Any]:
        """Every parameter's local shard, after releasing any gathered copy (a view: writing it writes the shard)."""
        if self.deepspeed:
            self.model.empty_partition_cache()
            return [p.ds_tensor for p in self.params]
        from torch.distributed.fsdp import FSDPModule  # lazy: heavy
        from torch.distributed.tensor import DTensor  # lazy: heavy

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return [p._local_tensor if isinstance(p, DTensor) else p.data for p in self.params]

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The model's parameters hold the copy's shards inside, the live ones again after (also on an error)."""
        import torch  # lazy: heavy

        with torch.no_grad():
            live = self._shards()
            kept = [shard.clone() for shard in live]
            for shard, saved in zip(live, self.saved, strict=True):
                shard.copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for shard, value in zip(self._shards(), kept, strict=True):
                    shard.copy_(value)
