"""Hooks for 2-process tests, loaded on every rank through FINETUNE_HOOKS: each rank's peak of live tensor bytes in
every training step, measured with no code shared with ``finetune plan``.

Loaded at the first hook that fires (after step 1, or when a rank tokenizes), the module wraps
``finetune.runtime.loop.train_step`` (``loop.train`` looks it up at every step). Inside each step a :class:`LiveBytes`
dispatch mode sees every storage an operator reads or writes, per rank, on plain tensors and inside tensor
subclasses (FSDP2's DTensor parameters, gradients and optimizer states), and counts the bytes of each storage it
has seen, as its current ``nbytes()``, until the storage is freed (a weakref on it). A storage seen first as an
input was alive before (parameters, optimizer states, DeepSpeed's flat buffers): after one whole step every
storage a step touches is known, so the steps from the second measured one on count everything a step uses.

Storages change size outside the dispatcher: FSDP2 and FSDP1 free an unsharded parameter's storage with
``untyped_storage().resize_(0)`` and allocate it again with ``resize_(n)``, which no operator reports. The module
therefore wraps ``torch.UntypedStorage.resize_`` (FSDP1's ``TypedStorage._resize_`` ends there too) so a resize
changes the count at once, and a storage grown from 0 that was not known yet starts being counted.

The mode hands tensors that only C++ held (DDP's buckets, the tensors of gloo's collectives) to Python, which gives
them Python objects; torch then takes the GIL wherever their last C++ reference goes, gloo's worker threads
included. ``destroy_process_group`` joins those threads while holding the GIL, so a collective's work still being
destroyed there deadlocked a rank at exit (seen once in eight runs). The module therefore makes the process group's
end wait for a barrier and a short GIL-free sleep first, so no work is in flight when the threads are joined.

After every measured step each rank writes ``<run_dir>.memory-<rank>.json``: per step, the peak bytes, the bytes
alive when the step began, and the rows and padded length of the step's longest micro-batch (the plan assumes
``micro_batch_size x max_seq_len`` tokens; the test plans each step at the length it really trained).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from finetune.runtime import loop
from tests.distributed.paths import side_file


def _plain_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The plain tensors of ``value``: itself, or the inner tensors of a wrapper subclass (DTensor's local shard)."""
    if is_traceable_wrapper_subclass(value):
        attrs, _ = value.__tensor_flatten__()
        for attr in attrs:
            yield from _plain_tensors(getattr(value, attr))
    elif isinstance(value, torch.Tensor):
        yield value


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages seen and alive now, and the most alive at once since :meth:`reset`."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage key (the C storage, shared by every view) -> bytes counted
        self.now = 0
        self.peak = 0

    def reset(self) -> None:
        self.peak = self.now

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def track(self, storage: Any, new_only_if_allocated: bool = False) -> None:
        """Count ``storage`` (or its new size, when known); with ``new_only_if_allocated`` an unknown storage is
        counted only when it holds bytes (a resize from 0)."""
        if storage.device.type == "meta":
            return
        key, size = storage._cdata, storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            if new_only_if_allocated and size == 0:
                return
            self.sizes[key] = size
            self.now += size
            weakref.finalize(storage, self._freed, key)
        elif old != size:
            self.sizes[key] = size
            self.now += size - old
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for leaf in tree_leaves((args, kwargs, out)):
            for tensor in _plain_tensors(leaf):
                try:
                    storage = tensor.untyped_storage()
                except (RuntimeError, NotImplementedError):  # sparse or other storage-less layouts
                    continue
                self.track(storage)
        return out


LIVE = LiveBytes()
_steps: list[dict[str, int]] = []
_original_resize = torch.UntypedStorage.resize_


def _resize(self: Any, size: int) -> Any:
    out = _original_resize(self, size)
    LIVE.track(self, new_only_if_allocated=True)
    return out


def _measured(train_step: Any) -> Any:
    def measured_train_step(t: Any, window: list[dict[str, Any]]) -> Any:
        longest = max(window, key=lambda b: b["input_ids"].shape[-1])["input_ids"]
        began = LIVE.now
        LIVE.reset()
        with LIVE:
            stats = train_step(t, window)
        _steps.append({"step": t.state.step + 1, "peak": LIVE.peak, "began": began, "rows": int(longest.shape[0]),
                       "seq": int(longest.shape[-1])})
        side_file(t.ctx.run_dir, f"memory-{t.ctx.accelerator.process_index}.json").write_text(
            json.dumps({"steps": _steps}))
        return stats

    return measured_train_step


def _quiet_end(destroy: Any) -> Any:
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError):  # bounded: a rank that died must not hold the others here
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
            time.sleep(0.5)  # releases the GIL: gloo's threads finish destroying their last works
        return destroy(*args, **kwargs)

    return destroy_process_group


dist.destroy_process_group = _quiet_end(dist.destroy_process_group)
torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]
loop.train_step = _measured(loop.train_step)
