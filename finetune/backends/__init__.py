"""The backends: one module per family behind one protocol (:class:`finetune.backends.base.Backend`).

- :mod:`~finetune.backends.whole`: one process and DDP (whole tensors);
- :mod:`~finetune.backends.fsdp`: FSDP versions 1 and 2;
- :mod:`~finetune.backends.deepspeed`: DeepSpeed ZeRO 1-3, with offload.

:mod:`~finetune.backends.select` builds the right one (from the launcher's environment, an accelerate config or a
manifest's name), :mod:`~finetune.backends.accelerator` sets up the Accelerator for it. Everything that depends on
the backend is asked of the object; no code outside this package tests which backend it is.
"""

from finetune.backends.accelerator import (
    export_module,
    extra_checkpoint_state,
    frozen_copy,
    full_state_dict,
    make_accelerator,
    model_init,
    process_group_kwargs,
    restrict_checkpoint_loading,
)
from finetune.backends.base import Backend, Sharding, backend_named, launcher_config_name, layout, sharding
from finetune.backends.deepspeed import (
    DEEPSPEED_REDUCE_BUCKET,
    ZERO3_PERSISTENCE_THRESHOLD,
    DeepSpeed,
    deepspeed_config,
    reduce_bucket_elements,
    size_deepspeed_buckets,
)
from finetune.backends.frozen import FrozenShards
from finetune.backends.fsdp import (
    Fsdp,
    FSDP1OptimizerState,
    fsdp_mixed_precision,
    restrict_dcp_metadata,
    shard_from_rank0,
)
from finetune.backends.select import (
    AccelerateConfig,
    accelerate_config,
    detect,
    effective_settings,
    from_accelerate_config,
)
from finetune.backends.setup import full_numel, full_shape, settle, unwrap_without_importing_deepspeed
from finetune.backends.whole import WholeModel

__all__ = [
    "DEEPSPEED_REDUCE_BUCKET",
    "ZERO3_PERSISTENCE_THRESHOLD",
    "AccelerateConfig",
    "Backend",
    "DeepSpeed",
    "FSDP1OptimizerState",
    "FrozenShards",
    "Fsdp",
    "Sharding",
    "WholeModel",
    "accelerate_config",
    "backend_named",
    "deepspeed_config",
    "detect",
    "effective_settings",
    "export_module",
    "extra_checkpoint_state",
    "from_accelerate_config",
    "frozen_copy",
    "fsdp_mixed_precision",
    "full_numel",
    "full_shape",
    "full_state_dict",
    "launcher_config_name",
    "layout",
    "make_accelerator",
    "model_init",
    "process_group_kwargs",
    "reduce_bucket_elements",
    "restrict_checkpoint_loading",
    "restrict_dcp_metadata",
    "settle",
    "shard_from_rank0",
    "sharding",
    "size_deepspeed_buckets",
    "unwrap_without_importing_deepspeed",
]
