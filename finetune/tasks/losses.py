"""Summed token cross-entropy that never materialises a full fp32 copy of the logits.

Why: the straightforward ``F.cross_entropy(logits.float(), ...)`` upcasts the whole ``[N, V]`` logits to fp32 (for
a 150k vocabulary at 4k tokens that alone is 2.4 GB per micro-batch), and autograd then keeps the fp32
log-softmax of the same size alive until backward. :func:`summed_cross_entropy` instead walks the flattened
logits in row chunks:

* forward runs one fused ``log_softmax`` per chunk, upcast to fp32 (only that chunk; fp32 logits are not copied)
  and keeps the target entries; it saves only the logits (which exist anyway) and the targets;
* backward recomputes a fused fp32 ``softmax`` chunk by chunk and writes ``(softmax - onehot(target)) * grad_out``
  (zero on ignored rows) into a gradient of the logits' own dtype.

Speed: the same fused kernels as ``F.cross_entropy`` (log_softmax forward, one softmax in backward instead of
log_softmax's backward over a dense one-hot gradient), and only over the rows that hold targets: long runs of
ignored rows (the padding of a right-padded batch, masked prompts) are skipped, their gradient is a plain zero fill
(:func:`target_segments`). ``F.cross_entropy`` computes a softmax for every row, so in a padded batch where 60% of
the rows are padding this loss does well under half of its work.

So the extra memory at any time is one fp32 chunk (``chunk_rows x V``) plus the gradient in the logits' dtype
(which autograd needs anyway), never a full fp32 ``[N, V]``.

Chunk size: by default :func:`default_chunk_rows` picks ``CHUNK_BYTES // (4 * V)`` rows (at least 1), i.e. about
64 MiB of fp32 per chunk: 524 rows for V = 32000, 110 rows for V = 152064. Big enough that per-chunk Python
overhead is negligible next to the ``rows x V`` exp/sum work, small enough to be noise next to the logits.

Fused kernels (e.g. ``liger_kernel``'s fused linear cross-entropy, which also avoids materialising the logits)
go further on GPU, but this module depends on nothing beyond torch and works on CPU and GPU alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from finetune.data.tokenize import IGNORE

CHUNK_BYTES = 64 * 2**20  # fp32 bytes per chunk: ~64 MiB
GAP_ROWS = 32  # ignored runs at least this long are skipped, shorter ones computed and masked (target_segments)


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk so that one fp32 chunk (``rows x vocab_size x 4`` bytes) is about ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * max(1, vocab_size)))


def _fp32_log_softmax(chunk: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """fp32 log-softmax of one chunk: fp32 logits are written into ``buffer`` (no fresh allocation per chunk: on
    CPU a fresh large tensor costs page faults), half-precision ones upcast this chunk only."""
    if buffer is None:
        return torch.log_softmax(chunk, dim=-1, dtype=torch.float32)
    out = buffer[: chunk.size(0)]
    torch._log_softmax(chunk, -1, False, out=out)
    return out


def target_segments(valid: torch.Tensor, chunk_rows: int, gap_rows: int = GAP_ROWS) -> list[tuple[int, int]]:
    """Row ranges ``[start, end)``, each at most ``chunk_rows`` long, in order, that cover every valid row.

    Runs of ignored rows (padding, masked prompts) of at least ``gap_rows`` rows between valid rows are left out:
    their loss is 0 and their gradient is 0, so computing a softmax over them is wasted work (in a right-padded
    batch most rows are padding). Shorter gaps stay inside a range and are masked there, which keeps the number of
    ranges, and so the Python work per range, small whatever the mask looks like: at most about
    ``N / gap_rows + N / chunk_rows`` ranges. One host sync (the run boundaries), once per forward.
    """
    flags = valid.reshape(-1).to(torch.int8)
    zero = flags.new_zeros(1)
    edges = torch.diff(flags, prepend=zero, append=zero)
    starts = (edges == 1).nonzero().squeeze(1).tolist()
    ends = (edges == -1).nonzero().squeeze(1).tolist()
    runs: list[list[int]] = []
    for start, end in zip(starts, ends, strict=True):
        if runs and start - runs[-1][1] < gap_rows:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return [(row, min(row + chunk_rows, end)) for start, end in runs for row in range(start, end, chunk_rows)]


class _SummedCrossEntropy(torch.autograd.Function):
    """Chunked summed cross-entropy over ``[N, V]`` logits and ``[N]`` targets; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        vocab = logits.size(1)
        segments = target_segments(targets != IGNORE, chunk_rows)
        # float64 accumulator over chunks: the chunk sums add up in a different order than one fused reduction,
        # and a wider accumulator keeps that difference far below fp32 rounding of the result.
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        rows = max((end - start for start, end in segments), default=0)
        buffer = logits.new_empty((rows, vocab)) if logits.dtype == torch.float32 and rows else None
        for start, end in segments:
            target = targets[start:end]
            valid = target != IGNORE
            logp = _fp32_log_softmax(logits[start:end], buffer)  # one fused kernel per chunk
            picked = logp.gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1)
            # where(), not a multiply: an ignored row with non-finite logits must add 0, not nan
            total -= torch.where(valid, picked, 0.0).sum(dtype=torch.float64)
        ctx.segments = segments
        ctx.save_for_backward(logits, targets)
        return total.to(torch.float32)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        logits, targets = ctx.saved_tensors
        scale = grad_out.to(torch.float32)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        covered = 0
        for start, end in ctx.segments:
            grad[covered:start].zero_()  # rows no segment covers are ignored targets: their gradient is 0
            covered = end
            chunk, target = logits[start:end], targets[start:end]
            valid = target != IGNORE
            if chunk.dtype == torch.float32:  # fused softmax straight into the gradient: no temporary at all
                probs = grad[start:end]
                torch._softmax(chunk, -1, False, out=probs)
            else:
                probs = torch.softmax(chunk, dim=-1, dtype=torch.float32)
            probs.mul_(scale)
            # minus grad_out at the target: (softmax - onehot) * grad_out, with softmax * grad_out rounded first
            hit = valid.nonzero().squeeze(1)
            probs[hit, target[hit]] -= scale
            probs.index_fill_(0, (~valid).nonzero().squeeze(1), 0.0)
            if probs.data_ptr() != grad[start:end].data_ptr():
                grad[start:end].copy_(probs)  # half precision: rounded once, from fp32
        grad[covered:].zero_()
        return grad, None, None


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Sum (fp32 scalar) of per-token cross-entropy over the targets that are not ``IGNORE``.

    ``logits`` is ``[..., V]`` in any float dtype (fp32, bf16, fp16) and ``targets`` the matching ``[...]`` long
    tensor. Equal to ``F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE,
    reduction="sum")`` but with one fp32 chunk of ``chunk_rows`` rows alive at a time (default:
    :func:`default_chunk_rows`). Pass contiguous logits: a non-contiguous tensor is copied once (in its own
    dtype) by the flattening reshape. For next-token loss, shift the labels rather than slicing the logits, e.g.
    ``F.pad(labels[:, 1:], (0, 1), value=IGNORE)``, so the logits stay contiguous.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}[:-1]")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    vocab = logits.size(-1)
    rows = default_chunk_rows(vocab) if chunk_rows is None else chunk_rows
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    return _SummedCrossEntropy.apply(logits.reshape(-1, vocab), targets.reshape(-1).long(), rows)
