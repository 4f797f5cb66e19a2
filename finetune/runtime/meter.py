"""What a train row reports besides the loss: the input tokens and sample lengths of a batch, the run's FLOPs model
(for ``flops_per_token`` and ``mfu``) and this device's memory peaks.

Why a module of its own: the worker builds the FLOPs model once, from the plain model before ``accelerator.prepare``
(:func:`step_flops`); the loop counts each batch on the host (:func:`input_lengths`, like ``Task.count_targets``:
no device sync) and reads the memory peaks (:func:`memory_peaks`); :class:`finetune.runtime.tracking.Throughput` turns
the counts into rates. The formula itself is :mod:`finetune.runtime.flops`. torch is imported inside the functions that
need it, so that :mod:`finetune.runtime.tracking` can name :class:`StepFlops` without importing torch. """

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.backends import full_numel
from finetune.data.tokenize import IGNORE
from finetune.runtime.flops import Param, attention_of, peak_flops, train_flops

GB = 1e9  # memory is logged in decimal gigabytes


@dataclass(frozen=True)
class StepFlops:
    """A step's training FLOPs as ``per_token x input tokens + per_square x sum(sample length^2)`` (both summed
    over the step's samples; :func:`finetune.runtime.flops.train_flops` is linear in these two), and ``peak``: this
    device's peak FLOP/s, None when unknown (the mfu is then omitted, never guessed)."""

    per_token: float
    per_square: float
    peak: float | None

    def of(self, tokens: float, squares: float) -> float:
        """The FLOPs of samples holding ``tokens`` input tokens whose squared lengths sum to ``squares``."""
        return self.per_token * tokens + self.per_square * squares


def _numel(param: Any) -> int:
    """The element count of the weight a parameter stands for: a 4-bit QLoRA weight stores two values per byte
    (its shape is the packed one; bitsandbytes keeps the real shape in ``quant_state.shape``); ZeRO-3 partitions
    parameters at birth (``backends.full_numel`` gives the whole size)."""

    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    if shape is not None:
        count = 1
        for n in shape:
            count *= int(n)
        return count
    return full_numel(param)


def _params(model: Any) -> tuple[list[Param], int]:
    """The formula's parameter list with whole sizes (:func:`_numel`), and the tied head's size (0 when the head
    has a weight of its own: a tied head is not listed by named_parameters)."""
    params = [Param(name, _numel(p), bool(p.requires_grad)) for name, p in model.named_parameters()]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    has_own = any("lm_head" in p.name.split(".") for p in params)
    tied = _numel(head.weight) if head is not None and getattr(head, "weight", None) is not None and not has_own \
        else 0
    return params, tied


def step_flops(model: Any, peak_tflops: float | None, device: Any) -> StepFlops | None:
    """The FLOPs model of ``model`` (the plain model, before ``accelerator.prepare``: names are unwrapped and sizes
    whole) and the peak of ``device`` (``train.peak_tflops``, else the table by CUDA device name; a CPU has none);
    None when the formula does not know a part of the model (a vision tower, a classification head)."""
    import torch  # lazy: heavy

    config = getattr(model, "config", None)  # a custom (factory) row has none: no formula, no MFU
    try:
        attention = attention_of(config) if config is not None else None
    except AttributeError:  # a config without the layer / head / width fields the formula reads
        attention = None
    if attention is None:
        return None
    params, tied = _params(model)
    one = train_flops(params, attention, [1], tied_head_numel=tied)
    two = train_flops(params, attention, [2], tied_head_numel=tied)
    if one is None or two is None:
        return None
    per_square = (two - 2 * one) / 2  # f([1]) = P + C, f([2]) = 2P + 4C
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None
    return StepFlops(per_token=one - per_square, per_square=per_square, peak=peak_flops(name, peak_tflops))


def input_lengths(batch: dict[str, Any], *, padded_tail: bool = False) -> tuple[int, int]:
    """(input tokens, sum of squared sample lengths) of one host micro-batch, padding left out.

    A packed row (the collator's ``cu_seq_lens_q``) counts each sample, not the row; with ``padded_tail``
    (``data.pack_to_multiple_of``) a last segment holding no target is the collator's padding segment and is left
    out. A padded batch counts each row's ``attention_mask``; a batch with neither counts every position."""
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        lens = (cu[1:] - cu[:-1]).long()
        labels = batch.get("labels")
        if padded_tail and labels is not None and lens.numel() and bool((labels[0, int(cu[-2]):] == IGNORE).all()):
            lens = lens[:-1]
    elif batch.get("attention_mask") is not None and batch["attention_mask"].dim() == 2:
        lens = batch["attention_mask"].long().sum(-1)
    elif batch.get("input_ids") is not None:
        rows, length = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
        return rows * length, rows * length * length
    else:
        return 0, 0
    return int(lens.sum()), int((lens * lens).sum())


def memory_peaks(device: Any) -> dict[str, float]:
    """``mem_alloc_gb`` / ``mem_reserved_gb``: this device's peak memory allocated and reserved by torch's caching
    allocator since the process started (allocator statistics: no device sync); empty off CUDA (not 0: unknown)."""
    import torch  # lazy: heavy

    if torch.device(device).type != "cuda":
        return {}
    return {"mem_alloc_gb": round(torch.cuda.max_memory_allocated(device) / GB, 3),
            "mem_reserved_gb": round(torch.cuda.max_memory_reserved(device) / GB, 3)}
