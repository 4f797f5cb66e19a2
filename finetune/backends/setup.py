"""What every backend shares to set up and tear down a process: the process group, accelerate's DeepSpeed check,
the end-of-run barrier, and a parameter's whole shape whichever backend holds it."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

from finetune.config import RecipeConfig


def timeout(cfg: RecipeConfig) -> timedelta:
    """``launch.timeout_minutes`` as the collective timeout."""
    return timedelta(minutes=cfg.launch.timeout_minutes)


def start_process_group(kwargs: dict[str, Any], cpu: bool) -> Any:
    """accelerate's shared PartialState, which creates the process group (DeepSpeed: ``deepspeed.init_distributed``)
    with ``kwargs`` passed as they are; the Accelerator created next adopts it. Not through accelerate's
    ``InitProcessGroupKwargs``: it passes on only the fields that differ from its NCCL defaults, so a 10-minute
    timeout was dropped (gloo then waited 30), and a PartialState created before it (FSDP on CPU) ignores it."""
    from accelerate import PartialState  # lazy: heavy

    return PartialState(cpu=cpu, **kwargs)


def unwrap_without_importing_deepspeed() -> None:
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


def settle(accelerator: Any) -> None:
    """Every rank, once its run has finished and before the process group is torn down: a barrier (so no rank is
    still inside a collective), then half a second without the GIL, so gloo's threads can free the work of the last
    collectives. Freeing a collective's tensors needs the GIL, and the process group's destructor joins those
    threads while holding it: a rank that got there while its last collective was still being freed hung for ever
    in ``~ProcessGroupGloo`` (seen in 2-process resumes, once rank 0 spent longer at the end writing the summary)."""

    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        time.sleep(0.5)  # releases the GIL


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
