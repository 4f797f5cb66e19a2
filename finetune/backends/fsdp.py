"""FSDP, versions 1 (flat parameters) and 2 (DTensor per parameter).

accelerate gets the decoder-layer class to wrap (from the row), ``use_orig_params`` (our optimizer groups see real
parameters), sharded state dicts for checkpoints, and no ``sync_module_states`` (every rank builds the same weights
from the same seed; the option raises on CPU). FSDP's mixed-precision policy casts the weights (autocast off; our
grad scaler still runs fp16). On CPU-only machines the shared PartialState is marked as a multi-device run before
the Accelerator exists, else accelerate silently falls back to DDP (docs/platform-notes.md).
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from finetune.backends import setup
from finetune.backends.base import Backend, Sharding
from finetune.backends.frozen import FrozenShards
from finetune.backends.fullstate import ReadState, in_groups, load_torch, quiet
from finetune.config import RecipeConfig
from finetune.errors import ConfigError, RunDirError
from finetune.registry import SupportedModel
from finetune.storage.checkpoints import read_state

FSDP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_TRUE = ("true", "1", "yes")


@dataclass(frozen=True)
class Fsdp(Backend):
    """FSDP ``fsdp_version`` 1 or 2. ``config``: the accelerate config's ``fsdp_config`` (sharding strategy and
    offload, which only the plan reads; the launcher hands them to accelerate itself)."""

    fsdp_version: int = 1
    # With gradient accumulation: keep whole (unsharded) fp32 gradients across the window's micro-steps and
    # reduce-scatter once at its end (less traffic, one model's worth of gradients per rank), instead of reducing
    # each micro-batch into the sharded gradients. Set only where finetune.runtime.plan says those gradients fit
    # (the worker asks it: ``worker.fsdp_accumulation``). See :attr:`syncs_each_micro_step`.
    keep_unsharded_grads: bool = False
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    kind = "fsdp"

    @classmethod
    def from_name(cls, name: str) -> Fsdp | None:
        return cls(int(name[-1])) if name in ("fsdp1", "fsdp2") else None

    @property
    def name(self) -> str:
        return f"fsdp{self.fsdp_version}"

    @property
    def flat(self) -> bool:
        """FSDP1: flat parameters, each holding a rank's shards of several tensors."""
        return self.fsdp_version == 1

    @property
    def casts_parameters(self) -> bool:
        """FSDP casts the weights itself for bf16/fp16 (FSDP2 ``MixedPrecisionPolicy``, FSDP1 ``MixedPrecision``:
        16-bit copies for the forward/backward, fp32 gradient reduction, fp32 sharded master weights)."""
        return True

    @property
    def sharded_scaler(self) -> bool:
        """FSDP1's flat gradient shards differ per rank, so an overflow found on one rank must skip the step on all
        (FSDP2's DTensor gradients already all-reduce the plain scaler's overflow check)."""
        return self.flat

    @property
    def syncs_each_micro_step(self) -> bool:
        """As torchtitan does, each micro-batch's gradients are reduce-scattered into the fp32 sharded gradients, so
        no rank holds whole unsharded gradients across micro-steps, unless :attr:`keep_unsharded_grads` says they
        fit. The sum is the same: the loop divides every micro-step by the window's tokens, and reduction is
        linear."""
        return not self.keep_unsharded_grads

    @property
    def may_keep_unsharded_grads(self) -> bool:
        return True

    @property
    def asks_whether_unsharded_grads_fit(self) -> bool:
        return not self.keep_unsharded_grads

    def with_unsharded_grads(self, keep: bool) -> Fsdp:
        return replace(self, keep_unsharded_grads=keep)

    @property
    def shards_parameters(self) -> bool:
        return True

    @property
    def weight_distribution(self) -> str:
        return "broadcast" if self.flat else "shard"

    def shard_from_rank0(self, accelerator: Any, enabled: bool) -> None:
        if not self.flat:
            shard_from_rank0(accelerator, enabled)

    @property
    def generates_unwrapped(self) -> bool:
        """Not under FSDP1, whose wrapped modules hold flat-sharded parameters outside the wrapper's own forward."""
        return not self.flat

    @property
    def rank_bound_state(self) -> bool:
        return True

    @property
    def sharding_text(self) -> str:
        return f"FSDP{self.fsdp_version} " + ("flat-parameter" if self.flat else "DTensor") + " shards (DCP)"

    @property
    def format_text(self) -> str:
        return "torch.distributed.checkpoint pytorch_model_fsdp_0/ + " + (
            "fsdp1_optimizer" if self.flat else "optimizer_0/")

    def extra_checkpoint_state(self, model: Any, optimizer: Any) -> dict[str, Any]:
        return {"fsdp1_optimizer": FSDP1OptimizerState(model, optimizer)} if self.flat else {}

    def restrict_checkpoint_loading(self) -> None:
        """DCP's ``.metadata`` pickle goes through :func:`restrict_dcp_metadata`."""
        restrict_dcp_metadata()

    def read_full_state(self, ckpt: Path, groups: list[list[str]] | None, scratch: Path | None) -> ReadState:
        """The DCP model folder (clean FQN keys); the optimizer from FSDP1's whole copy (``fsdp1_optimizer``) or
        FSDP2's DCP optimizer folder. Both are read in place: ``scratch`` is unused."""

        model = read_dcp(ckpt / "pytorch_model_fsdp_0").get("model")
        if not isinstance(model, dict):
            raise RunDirError(f"{ckpt / 'pytorch_model_fsdp_0'}: holds no model state")
        model = {k: v.contiguous() for k, v in model.items()}
        if groups is None:
            return model, None
        optim = (read_state(ckpt, "fsdp1_optimizer") if self.flat  # FSDP1: our whole copy; FSDP2: a DCP folder
                 else read_dcp(ckpt / "optimizer_0").get("optimizer"))
        if not isinstance(optim, dict) or not isinstance(optim.get("param_groups"), list):
            raise RunDirError(f"{ckpt}: holds no FSDP optimizer state")
        return model, in_groups(optim.get("state") or {}, optim["param_groups"], groups, ckpt)

    def load_full_state(self, accelerator: Any, model: Any, optimizer: Any, full: dict[str, Any],
                        optim: dict[str, Any], *, adapter_only: bool) -> None:
        """torch.distributed.checkpoint's full-state-dict setters (:func:`~finetune.backends.fullstate.load_torch`):
        each rank keeps its shards of the whole tensors."""
        load_torch(model, optimizer, full, optim, accelerator.unwrap_model(model), adapter_only)

    def full_state_dict(self, accelerator: Any, model: Any) -> dict[str, Any] | None:
        """FSDP1's default full-state-dict gather offloads to CPU and segfaults on a CPU-only run
        (docs/platform-notes.md), so it is gathered on the compute device (rank 0 only) there."""
        if not self.flat:
            return super().full_state_dict(accelerator, model)
        import torch  # lazy: heavy
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType  # lazy: heavy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # lazy: heavy

        config = FullStateDictConfig(offload_to_cpu=torch.cuda.is_available(), rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()

    def export_module(self, accelerator: Any, model: Any, state_dict: dict[str, Any] | None,
                      rebuild: Callable[[], Any] | None) -> Any:
        """FSDP1 renames the modules it wraps (``_fsdp_wrapped_module``), so peft, which looks its adapter up by
        module name, finds none in the gathered state dict and saves an empty adapter. Under FSDP1 a PEFT model is
        therefore saved from a fresh unwrapped copy (``rebuild()``) loaded with the gathered weights."""
        unwrapped = accelerator.unwrap_model(model)
        if not (self.flat and hasattr(unwrapped, "peft_config")):
            return unwrapped
        if rebuild is None or state_dict is None:
            raise RuntimeError("an FSDP1 PEFT export needs a rebuild factory and the gathered state dict")
        saver = rebuild()
        saver.load_state_dict(state_dict)
        return saver

    def frozen_copy(self, accelerator: Any, model: Any) -> tuple[Any, Callable[[], Any]]:
        """FSDP2: :class:`FrozenShards`, the policy module itself scores with this rank's shards of the copy swapped
        in. FSDP1: refused (recipe validation refuses it first): its flat parameters hold a rank's shards of several
        tensors at once, with views that FSDP re-points as it gathers; copying into them is not a supported write."""
        if self.flat:
            raise ConfigError("a frozen copy of the weights (grpo.beta > 0 with full fine-tuning) is not built under "
                              "FSDP1; use launch.accelerate_config=fsdp2 or zero3, peft (LoRA), or grpo.beta=0")
        return model, FrozenShards(model, deepspeed=False).swapped

    @property
    def shards_frozen_module(self) -> bool:
        """FSDP2 shards a frozen module as the model; FSDP1 keeps it whole (:meth:`frozen_module`)."""
        return not self.flat

    def frozen_module(self, accelerator: Any, module: Any, cfg: RecipeConfig, model: Any) -> tuple[Any, bool]:
        """FSDP2: ``fully_shard`` on each of the module's decoder layers (its ``_no_split_modules``) and its root, on
        the model's device mesh with the model's mixed-precision policy: each rank holds 1/world of it, and a forward
        gathers a layer at a time, as the model's does. FSDP1: whole on every rank (its flat parameters are not built
        for a second, frozen root)."""
        if not self.shards_frozen_module:
            return super().frozen_module(accelerator, module, cfg, model)
        from torch.distributed.fsdp import fully_shard  # lazy: heavy
        from torch.distributed.tensor import DTensor  # lazy: heavy

        mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
        policy = fsdp_mixed_precision(cfg.train.mixed_precision, 2)
        options: dict[str, Any] = {"mesh": mesh, **({"mp_policy": policy} if policy is not None else {})}
        layers = set(getattr(module, "_no_split_modules", None) or ())
        for sub in module.modules():
            if type(sub).__name__ in layers:
                fully_shard(sub, **options)
        fully_shard(module, **options)  # moves each shard to the mesh's device
        return module, True

    def effective(self, cfg: RecipeConfig, row: SupportedModel, data: Mapping[str, Any]) -> dict[str, Any]:
        half = {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.train.mixed_precision)
        return {"fsdp": {**(data.get("fsdp_config") or {}), "transformer_cls_names_to_wrap": list(row.wrap_classes),
                         "use_orig_params": True, "sync_module_states": False,
                         "mixed_precision_policy": {"param_dtype": half, "reduce_dtype": "float32"} if half else None,
                         "reduce_each_micro_step": self.syncs_each_micro_step and cfg.grad_accum > 1}}

    def plugins(self, cfg: RecipeConfig, row: SupportedModel, on_cpu: bool, group: dict[str, Any]) -> dict[str, Any]:
        from accelerate.utils import FullyShardedDataParallelPlugin  # lazy: heavy
        from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig  # lazy: heavy

        if on_cpu:
            _mark_cpu_run_as_multi_device(group)
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=self.fsdp_version, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=list(row.wrap_classes), use_orig_params=True, sync_module_states=False,
            state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False,
            mixed_precision_policy=fsdp_mixed_precision(cfg.train.mixed_precision, self.fsdp_version),
            # accelerate's default offload_to_cpu=True is meant for GPUs; on a CPU run it is a copy at best
            state_dict_config=ShardedStateDictConfig(offload_to_cpu=not on_cpu),
            optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=not on_cpu),
        )}

    def split_over(self, world: int, num_machines: int) -> Sharding:
        """Per the sharding strategy: FULL_SHARD (FSDP2 ``reshard_after_forward: true``) all three; SHARD_GRAD_OP
        gradients and optimizer states; NO_SHARD nothing; HYBRID_* the same within one machine."""
        strategy = fsdp_strategy(self.config)
        group = max(1, world // max(1, num_machines)) if strategy.startswith("HYBRID") else world
        full = strategy in ("FULL_SHARD", "HYBRID_SHARD")
        shard = 1 if strategy == "NO_SHARD" else group
        offload = str(self.config.get("fsdp_offload_params", False)).lower() in _TRUE
        what = "nothing sharded" if shard == 1 else (
            ("parameters, gradients and optimizer states" if full else "gradients and optimizer states")
            + f" / {shard}" + (" (within each machine)" if strategy.startswith("HYBRID") else "")
            + ("" if full else "; parameters stay whole from forward to backward"))
        return Sharding(self.name, self.kind, world, shard if full else 1, shard, shard, params_on_host=offload,
                        grads_on_host=offload, optimizer_on_host=offload, gathers=full and shard > 1, engine=self,
                        description=f"FSDP {strategy}: {what}"
                        + ("; parameters, gradients and optimizer states offloaded to CPU memory" if offload else ""))


def fsdp_strategy(fsdp: Mapping[str, Any]) -> str:
    """FSDP1's ``fsdp_sharding_strategy`` (a name or 1-5), else ``fsdp_reshard_after_forward`` (a bool for FSDP2, a
    strategy name for FSDP1), as accelerate reads them; FULL_SHARD when neither is set."""
    for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
        value = fsdp.get(key)
        if value is None:
            continue
        if isinstance(value, bool):
            return "FULL_SHARD" if value else "SHARD_GRAD_OP"
        text = str(value).strip().upper()
        if text in ("TRUE", "FALSE"):
            return "FULL_SHARD" if text == "TRUE" else "SHARD_GRAD_OP"
        if text.isdigit() and 1 <= int(text) <= len(FSDP_STRATEGIES):
            return FSDP_STRATEGIES[int(text) - 1]
        if text in FSDP_STRATEGIES:
            return text
        raise ConfigError(f"launch.accelerate_config: {key}={value!r} is not an FSDP sharding strategy; use one of "
                          f"{', '.join(FSDP_STRATEGIES)} (or true/false for fsdp_reshard_after_forward)")
    return "FULL_SHARD"


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
    shared PartialState on the CPU (``group``: the process group's keywords) and mark it as one before the
    Accelerator reads it."""
    import torch  # lazy: heavy
    from accelerate.utils import DistributedType  # lazy: heavy

    state = setup.start_process_group(group, cpu=True)
    state.distributed_type = DistributedType.MULTI_GPU
    state.device = torch.device("cpu")


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


# What a torch.distributed.checkpoint ``.metadata`` pickle may construct: DCP's own metadata records, torch.Size,
# dtypes, layouts and paths. Nothing else: a planted payload fails to load instead of running.
_DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


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


def read_dcp(folder: Path) -> dict[str, Any]:
    """Every key of a torch.distributed.checkpoint folder, loaded whole in this process without a process group
    (what torch's own ``format_utils.dcp_to_torch_save`` does; the public ``dcp.load`` fills only keys it is
    given)."""
    from torch.distributed.checkpoint import FileSystemReader  # lazy: heavy
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # lazy: heavy
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # lazy: heavy

    restrict_dcp_metadata()
    state: dict[str, Any] = {}
    with quiet():
        _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return state
