"""The Accelerator for a recipe, set up for the backend the launcher chose, and the calls the rest of finetune
makes on a backend by function (each asks the backend object, which answers for its family).

Mixed precision stays ours (finetune.runtime.precision) except under DeepSpeed, whose engine owns it, and FSDP, whose
mixed-precision policy casts the weights (autocast off; our grad scaler still runs fp16).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from finetune.backends.base import Backend
from finetune.backends.fullstate import tied_aliases
from finetune.backends.select import detect
from finetune.config import RecipeConfig
from finetune.registry import SupportedModel


def make_accelerator(cfg: RecipeConfig, row: SupportedModel, backend: Backend | None = None) -> tuple[Any, Backend]:
    """An Accelerator for this rank, and the backend it runs.

    ``gradient_accumulation_steps`` is the recipe's: the loop uses ``accelerator.accumulate`` so every backend
    (DeepSpeed included) knows which micro-step ends a window; whether gradients are also reduced on the other
    micro-steps is :attr:`Backend.syncs_each_micro_step`. Precision stays ``no`` for accelerate: autocast and the
    scaler are ours (finetune.runtime.precision), and FSDP gets its own policy
    (:func:`finetune.backends.fsdp.fsdp_mixed_precision`).
    """
    import torch  # lazy: heavy
    from accelerate import Accelerator  # lazy: heavy

    backend = backend or detect()
    on_cpu = not torch.cuda.is_available()
    group = backend.process_group_kwargs(cfg, on_cpu)
    return Accelerator(**backend.accelerator_kwargs(cfg, row, on_cpu, group)), backend


def process_group_kwargs(cfg: RecipeConfig, backend: Backend, on_cpu: bool) -> dict[str, Any]:
    """``init_process_group``'s keywords for this run (:meth:`Backend.process_group_kwargs`)."""
    return backend.process_group_kwargs(cfg, on_cpu)


def model_init(accelerator: Any, backend: Backend, from_config: bool) -> AbstractContextManager[None]:
    """Build the model in here (:meth:`Backend.model_init`)."""
    return backend.model_init(accelerator, from_config)


def extra_checkpoint_state(backend: Backend, model: Any, optimizer: Any) -> dict[str, Any]:
    """Objects to checkpoint (by name) on top of what accelerate saves for this backend."""
    return backend.extra_checkpoint_state(model, optimizer)


def restrict_checkpoint_loading(backend: Backend) -> None:
    """Data-only loading of the backend's own checkpoint format, on top of ``weights_only`` for every ``torch.load``
    (finetune.artifacts.checkpoint.forbid_unpickling). Each is set up only for its own backend: importing
    torch.distributed.checkpoint alone costs half a second."""
    backend.restrict_checkpoint_loading()


def export_module(accelerator: Any, model: Any, backend: Backend, state_dict: dict[str, Any] | None,
                  rebuild: Callable[[], Any] | None) -> Any:
    """The module whose ``save_pretrained(state_dict=...)`` writes the export, on rank 0
    (:meth:`Backend.export_module`)."""
    return backend.export_module(accelerator, model, state_dict, rebuild)


def full_state_dict(accelerator: Any, model: Any, backend: Backend) -> dict[str, Any] | None:
    """The whole model's state dict on rank 0 (None elsewhere may occur); a collective: call on every rank.

    A tied parameter (Gemma's, small Qwen3's input and output embeddings) is in it once, under its first name, as
    ``save_pretrained`` writes a model's own state dict: a sharded backend's gather makes one whole copy per name,
    which save_pretrained cannot see are the same weight, and the export would hold the embedding twice."""
    state = backend.full_state_dict(accelerator, model)
    if state:
        for alias, first in tied_aliases(accelerator.unwrap_model(model)).items():
            if alias in state and first in state:
                del state[alias]
    return state


def frozen_copy(accelerator: Any, model: Any, backend: Backend) -> tuple[Any, Callable[[], Any]]:
    """A frozen copy of the prepared ``model``'s current weights, as (the module that scores with it, a factory of
    the context it scores in): for a reference that only runs forward passes (GRPO's KL term with full
    fine-tuning). Neither is registered with the accelerator or a checkpoint object, so the copy is never saved.
    Unsharded parameters: a deep copy; FSDP2 and ZeRO-3: this rank's shards of the copy swapped into the policy's
    own parameters inside the context (:class:`finetune.backends.frozen.FrozenShards`); FSDP1: refused."""
    return backend.frozen_copy(accelerator, model)
