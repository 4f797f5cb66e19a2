"""DeepSpeed ZeRO stages 1-3, with optional CPU offload.

The whole DeepSpeed config is generated from the recipe (global/micro batch, accumulation, clipping, precision,
ZeRO stage and offload), so the two can never disagree. The engine owns mixed precision (it casts the model and
keeps fp32 master weights). On CPU-only machines DeepSpeed needs a gloo process group and must NOT get
``cpu=True``, which would silently run DDP (docs/platform-notes.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from finetune.backends import setup
from finetune.backends.base import Backend, Sharding
from finetune.backends.frozen import FrozenShards
from finetune.config import RecipeConfig
from finetune.errors import ConfigError
from finetune.registry import SupportedModel

T = TypeVar("T")

DEEPSPEED_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (not set by us)
_SHARDING = {(1, False): "ZeRO-1 optimizer partitions", (2, False): "ZeRO-2 optimizer and gradient partitions",
             (3, False): "ZeRO-3 partitions", (3, True): "ZeRO-3 partitions, optimizer on CPU"}


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

    def pick(self, *, whole: T, fsdp: T, deepspeed: T) -> T:
        return deepspeed

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
