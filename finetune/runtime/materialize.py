"""Load pretrained weights once: with several processes, rank 0 reads ``model.path`` and the other ranks receive it.

Without this every rank runs ``from_pretrained``: each reads the whole checkpoint from disk and holds a whole copy
(plus the file pages it mapped) even where the backend then keeps only a shard. Here, when more than one process
loads pretrained weights (:func:`plan`):

- rank 0 loads them with ``from_pretrained`` as one process does;
- every other rank builds the same model on the meta device from the folder's config (no weight file is read:
  :func:`finetune.runtime.modeling.build_model` with ``empty``), gives it uninitialised storage (never written, so never
  resident) and re-ties its shared weights;
- all ranks check that they built the same structure (names, shapes, dtypes, ties, train/eval mode; a mismatch,
  e.g. a checkpoint whose ties differ from its config, makes those ranks read the weights after all, with a
  warning), then fill it as the backend wants (:attr:`finetune.backends.Backend.weight_distribution`): every
  parameter and buffer broadcast from rank 0 (DDP, ZeRO-1/2, FSDP1), or only the buffers now and each rank's
  shards when FSDP2 wraps it (:func:`finetune.backends.shard_from_rank0`). Under ZeRO-3 transformers already
  partitions at birth and reads tensor data on rank 0 only, so nothing changes there.

Config-built models (``model.path`` null), one process and QLoRA (4-bit weights are placed at load time) keep the
plain build. ``FINETUNE_LOAD_EVERYWHERE=1`` restores reading on every rank: an escape hatch, and how
``scripts/measure_load_rss.py`` measures the old behaviour from the same code.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from finetune.backends import Backend
from finetune.errors import ConfigError

ENV = "FINETUNE_LOAD_EVERYWHERE"
_ON, _OFF = ("1", "true", "yes"), ("", "0", "false", "no")


def load_everywhere(env: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`ENV` asks every rank to read the weights itself; a value that is neither on nor off is a
    mistake (one line naming the variable)."""
    value = (os.environ if env is None else env).get(ENV, "").strip().lower()
    if value not in _ON + _OFF:
        raise ConfigError(f"{ENV}={value!r}: use 1 (every rank reads model.path itself) or 0 (rank 0 reads it once, "
                          "the default)")
    return value in _ON


@dataclass(frozen=True)
class LoadPlan:
    """How this rank gets its model: ``strategy`` is ``everywhere`` (build it as one process does), ``library``
    (the same call; the library loads once itself), ``broadcast`` or ``shard`` (see the module docstring);
    ``reason`` says why, for the run's log."""

    strategy: str
    rank: int
    reason: str

    @property
    def builds_empty(self) -> bool:
        """This rank builds the model without reading weights and receives them from rank 0."""
        return self.rank != 0 and self.strategy in ("broadcast", "shard")

    @property
    def collective(self) -> bool:
        """Every rank takes part in :func:`build` after the model is built (the structure check, broadcasts)."""
        return self.strategy in ("broadcast", "shard")


def plan(backend: Backend, world_size: int, rank: int, pretrained: bool, quantized: bool,
         env: Mapping[str, str] | None = None) -> LoadPlan:
    """The load plan of ``rank`` of ``world_size`` under ``backend``, for a model with pretrained weights
    (``pretrained``: ``model.path`` is set) or built from its config, quantized at load time (QLoRA) or not.
    :data:`ENV` is checked first, so a bad value is refused whatever the run."""
    everywhere = load_everywhere(env)
    if world_size <= 1:
        return LoadPlan("everywhere", rank, "one process")
    if not pretrained:
        return LoadPlan("everywhere", rank, "built from its config (model.path null): the same seed on every rank")
    if quantized:
        return LoadPlan("everywhere", rank, "QLoRA places 4-bit weights while loading")
    strategy = backend.weight_distribution
    if strategy == "library":
        return LoadPlan(strategy, rank, f"{backend.name}: transformers partitions at birth and reads on rank 0 only")
    if everywhere:
        return LoadPlan("everywhere", rank, f"{ENV}=1")
    return LoadPlan(strategy, rank, f"{backend.name}: rank 0 reads model.path, the other ranks receive "
                                    + ("every tensor" if strategy == "broadcast" else "their shards"))


def signature(model: Any) -> str:
    """What two ranks must agree on before one fills the other's model: each parameter (shared ones once, under
    their first name, so ties show) and buffer with its shape and dtype, whether it trains, and the train/eval
    mode; one line each."""
    lines = [f"mode {'train' if model.training else 'eval'}"]
    lines += [f"param {name} {tuple(p.shape)} {p.dtype} {'grad' if p.requires_grad else 'frozen'}"
              for name, p in model.named_parameters()]
    lines += [f"buffer {name} {tuple(b.shape)} {b.dtype}" for name, b in model.named_buffers()]
    return "\n".join(lines)


def first_difference(mine: str, reference: str, rank: int) -> str:
    """The first line where rank ``rank``'s :func:`signature` differs from rank 0's, as ``rank 0 has X, rank R
    Y``; empty when they are the same."""
    a, b = reference.splitlines(), mine.splitlines()
    for i in range(max(len(a), len(b))):
        theirs, ours = (a[i] if i < len(a) else "nothing"), (b[i] if i < len(b) else "nothing")
        if theirs != ours:
            return f"rank 0 has {theirs}, rank {rank} {ours}"
    return ""


def persistent_buffers(model: Any) -> list[str]:
    """Buffers saved in the state dict. accelerate's FSDP2 distribution from rank 0 handles parameters and
    non-persistent buffers only, so a model with these is filled by broadcast instead."""
    state = model.state_dict(keep_vars=True)
    return [name for name, _ in model.named_buffers() if name in state]


def materialize_empty(model: Any) -> Any:
    """Give a meta-device model uninitialised CPU storage (no page is written, so none is resident yet), then
    re-tie what ``to_empty`` untied (it makes new parameter objects) as the model's own ``tie_weights`` does."""
    model.to_empty(device="cpu")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def _broadcast(tensor: Any, device: Any) -> None:
    """Rank 0's values of ``tensor`` into ``tensor`` on every rank, through ``device`` (the process group's) when
    the tensor lives elsewhere."""
    import torch  # lazy: heavy
    import torch.distributed as dist  # lazy: heavy

    with torch.no_grad():
        data = tensor.detach()
        if data.device == device and data.is_contiguous():
            dist.broadcast(data, src=0)
            return
        staged = data.to(device).contiguous() if dist.get_rank() == 0 else torch.empty_like(data, device=device)
        dist.broadcast(staged, src=0)
        if dist.get_rank() != 0:
            data.copy_(staged)


def _broadcast_text(text: str, device: Any, src: int = 0) -> str:
    """Rank ``src``'s ``text`` on every rank, as bytes in a tensor (nothing is pickled)."""
    import torch  # lazy: heavy
    import torch.distributed as dist  # lazy: heavy

    encoded = bytearray(text.encode())
    payload = torch.frombuffer(encoded, dtype=torch.uint8) if encoded else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    sending = dist.get_rank() == src
    data = payload.to(device) if sending else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src)
    return data.cpu().numpy().tobytes().decode()


def _first_rank(flag: bool, rank: int, world: int, device: Any) -> int | None:
    """The lowest rank where ``flag`` is true, or None (all ranks get the same answer)."""
    import torch  # lazy: heavy
    import torch.distributed as dist  # lazy: heavy

    value = torch.tensor([rank if flag else world], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item()) if value.item() < world else None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build(accelerator: Any, backend: Backend, pretrained: bool, quantized: bool,
          make: Callable[[bool], Any]) -> tuple[Any, dict[str, str] | None]:
    """This rank's base model, and a row for the run's log (``tracker.log("info", row)``; None when there is
    nothing to say).

    ``make(empty)`` builds the base model: with pretrained weights, or (``empty``) the same model without them on
    the meta device. A collective when the plan is: every rank must call it."""
    rank, world = accelerator.process_index, accelerator.num_processes
    how = plan(backend, world, rank, pretrained, quantized)
    if not how.collective:
        model = make(False)
        if how.strategy == "library":
            return model, {"message": f"model: read from model.path once ({how.reason})"}
        return model, ({"message": f"model: every rank reads model.path ({how.reason})"}
                       if world > 1 and pretrained else None)
    device = accelerator.device
    model = materialize_empty(make(True)) if how.builds_empty else make(False)
    mine = signature(model)
    difference = first_difference(mine, _broadcast_text(mine, device), rank)
    first = _first_rank(bool(difference), rank, world, device)
    if first is not None:  # the same decision on every rank, and the same words for the log
        difference = _broadcast_text(difference, device, src=first)
        note = (f"warning: model: the model built from model.path's config differs from the one rank 0 loaded "
                f"({difference}); every rank reads the weights itself (set {ENV}=1 to skip this check)")
        if how.builds_empty:
            model = make(False)
        return model, {"level": "warning", "message": note}
    strategy = how.strategy
    if strategy == "shard" and persistent_buffers(model):
        strategy = "broadcast"
    tensors = list(model.named_buffers())
    if strategy == "broadcast":
        tensors = list(model.named_parameters()) + tensors
    for _, tensor in tensors:
        _broadcast(tensor, device)
    backend.shard_from_rank0(accelerator, strategy == "shard")  # FSDP2 only; the others ignore it
    received = "its shards when FSDP2 wraps it" if strategy == "shard" else "every parameter and buffer"
    return model, {"message": f"model: read from model.path by rank 0 only; {world - 1} other rank(s) built it empty "
                              f"and received {received} ({backend.name}, structure {_digest(mine)})"}
