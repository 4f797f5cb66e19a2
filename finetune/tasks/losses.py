"""One log-prob primitive for every causal objective: per-sequence sums of target log-probs, computed from the final
hidden states and the output head chunk by chunk, with no host sync and no data-dependent shape.

Why: full ``[tokens x vocab]`` logits are the largest tensors of a fine-tuning step (16k tokens at a 152k vocabulary
are 5 GB in bf16, 10 GB in fp32, and autograd keeps them, or their fp32 log-softmax, until backward).
:func:`sequence_logprobs` never builds them. For each fixed chunk of rows it computes ``logits = hidden @ W^T (+ b)``,
an fp32 log-softmax of that chunk only, and picks each row's target. Summed token cross-entropy (SFT), a DPO policy's
per-sequence log-probs and token accuracy are all this one function: the summed loss is minus the sum over one
"sequence" (:func:`summed_cross_entropy`).

Gradients: the gradient of a row's target log-prob with respect to its logits is ``g = onehot(target) - softmax``,
times the upstream gradient of the row's sequence, which is known only in backward. When a backward will follow
(grad mode on, an input needs a gradient) and one scale per row finishes every gradient, they are computed in
forward from the chunk's softmax while it exists: ``g @ W`` into an ``[N, H]`` buffer for the hidden states, and
``g^T h`` (and ``g.sum(0)`` for a bias) into one fp32 ``[V, H]`` buffer for the head. That is the case for one
sequence (SFT's summed loss: the scale is the same for every row) and for a head that needs no gradient (LoRA, a
frozen head: only the hidden states' gradient, scaled per row). Backward then only multiplies by the upstream
gradient (``index_select`` of each row's sequence), so a training step does the three ``N x H x V`` products that
autograd through full logits does (logits, hidden gradient, head gradient), not four. With several sequences AND a
trainable head (a DPO policy training its head) the head's gradient would need one ``[V, H]`` buffer per sequence,
so backward recomputes each chunk's logits and softmax instead and accumulates both gradients then; so does an fp16
compute dtype (fp16 training's loss scale is applied before the products there, which keeps their small entries
out of fp16's subnormal range; on the early path they would be computed unscaled). Either way the extra memory is
one chunk of logits plus its fp32 softmax and gradient, and the two buffers (the early path keeps them from forward
to backward in place of the hidden states and head weight the recompute path saves).

No host syncs: chunk boundaries are fixed by the static row count and :func:`default_chunk_rows`; ignored targets
are masked with ``where`` and gathered at a clamped index; per-sequence sums use ``index_add_`` over a fixed-size
output. Nothing calls ``nonzero``, ``.item()``, ``masked_select``, ``unique`` or indexes with a boolean mask, so a
GPU never waits for the host inside the loss (``tests/unit/test_losses.py`` counts the dispatched ops). The price is
that rows without a target (padding, masked prompts) are computed like the others and masked: skipping them would
need their positions on the host, i.e. a sync per micro-batch.

Precision: the chunk's logits are computed in the dtype the model's head would use (the autocast dtype when autocast
is on, else the weight's dtype), then log-softmax in fp32; sums accumulate in float64, so the chunked sum differs
from one fused reduction by far less than fp32 rounding of the result. ``g`` is fp32 (on the early path the softmax
is ``exp`` of that log-softmax, as autograd's log-softmax backward computes it), cast to the compute dtype for the
products. The head's gradient accumulates in fp32 and is cast once to the weight's dtype; the hidden states'
gradient has their dtype. On the early path the upstream scale multiplies the products (``s * (g @ W)``) rather
than ``g`` (``(s * g) @ W``): in fp32 the two differ by fp32 rounding (~1e-7 relative); with half-precision hidden
states the scaled gradient is rounded twice (the product, then the scaled product) instead of once.

Heads: a plain ``nn.Linear`` (or just a weight and bias, which covers tied embeddings: the weight is the embedding
matrix) takes the fused path above. Any other head module (a LoRA-adapted or ``modules_to_save``-wrapped head) is
called on each chunk under activation checkpointing, so its logits are likewise recomputed in backward instead of
being saved. ``head=None`` and no weight: ``hidden`` already holds logits (a custom model whose head is not named).

Shaped logits: a family whose forward changes its head's output (Granite divides the logits by ``logits_scaling``,
Gemma soft-caps them, ``cap * tanh(logits / cap)``) gets the same change per chunk (``divisor``, ``softcap``), in fp32,
before the log-softmax; the gradient with respect to the head's output is then ``g * (1 - (capped / cap)^2) /
divisor``: the soft-cap's factor multiplies each chunk's ``g``, the divisor scales the upstream gradient as the
temperature does. Both are monotonic, so the argmax (token accuracy) is the head's own.

Chunk size (:func:`default_chunk_rows`): about ``CHUNK_BYTES[device type]`` of fp32 per chunk. On CPU 64 MiB (524 rows
at V = 32000, 110 at V = 152064): big enough that per-chunk Python overhead is noise next to the ``rows x V``
work. On CUDA 256 MiB (441 rows at V = 152064): GEMMs of a few hundred rows by the hidden size run near peak
throughput, and one chunk's transients (compute-dtype logits, fp32 softmax, fp32 gradient) stay under 1 GiB.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from finetune.data.rows import IGNORE

CHUNK_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}  # fp32 bytes of one chunk of logits, per device type
DEFAULT_CHUNK_BYTES = 64 * 2**20  # any other device type


def default_chunk_rows(vocab_size: int, device: str | torch.device = "cpu") -> int:
    """Rows per chunk so that one fp32 chunk (``rows x vocab_size x 4`` bytes) is about ``CHUNK_BYTES`` of the
    device type (at least 1 row)."""
    kind = device if isinstance(device, str) else device.type
    return max(1, CHUNK_BYTES.get(kind, DEFAULT_CHUNK_BYTES) // (4 * max(1, vocab_size)))


def compute_dtype(reference: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype the head's matmul runs in: the autocast dtype when autocast is on for the tensor's device (as
    ``F.linear`` would run under it), else the weight's dtype (the logits' own dtype without a weight)."""
    kind = reference.device.type
    if weight is not None and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return (weight if weight is not None else reference).dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits (``weight`` and ``bias`` already in the compute dtype; no weight: ``hidden`` is logits)."""
    if weight is None:
        return hidden
    return torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The chunk's logits divided by ``temperature``, in fp32 (the distribution a sampler at that temperature draws
    from is their softmax); at 1 the logits themselves, not even copied, so every result at 1 is what it was."""
    if temperature == 1.0:
        return logits
    scaled = logits.to(torch.float32)
    return scaled / temperature if scaled is logits else scaled.div_(temperature)  # never divide the input in place


def _shaped(logits: torch.Tensor, divisor: float, softcap: float | None, in_place: bool = False) -> torch.Tensor:
    """The chunk's logits as the family's forward shapes its head's output: divided by ``divisor``, then soft-capped
    (``softcap * tanh(x / softcap)``), in fp32; the logits themselves (not even copied) when it changes nothing.
    ``in_place``: the steps after the first copy reuse its memory (no autograd records them)."""
    if divisor == 1.0 and softcap is None:
        return logits
    shaped = logits.to(torch.float32) / divisor  # a new tensor: the head's output is never changed
    if softcap is None:
        return shaped
    if in_place:
        return shaped.div_(softcap).tanh_().mul_(softcap)
    return torch.tanh(shaped / softcap) * softcap


def _softcap_factor(shaped: torch.Tensor, softcap: float | None) -> torch.Tensor | None:
    """``d shaped / d (logits / divisor)`` of a soft-capped chunk, ``1 - (shaped / softcap)^2``, in place on
    ``shaped`` (not needed afterwards); None without a soft-cap (the factor is 1)."""
    if softcap is None:
        return None
    return shaped.div_(softcap).square_().neg_().add_(1.0)


def _pick(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-softmax of the chunk (at ``temperature``) at each row's target, 0 where the row has none (``where``,
    not a multiply: an ignored row with non-finite logits must add 0, not nan)."""
    return _picked(torch.log_softmax(_tempered(logits, temperature), dim=-1, dtype=torch.float32), target, valid)


def _picked(logp: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's entry of the chunk's fp32 log-softmax ``logp`` at its target, 0 where the row has none."""
    return torch.where(valid, logp.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)


def _hits(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 where the chunk's argmax is the row's target (teacher-forced token accuracy), else 0."""
    return ((logits.argmax(-1) == target) & valid).long()


def _logit_grad(probs: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """In place on the chunk's fp32 softmax ``probs``: the gradient of the rows' target log-probs with respect to
    their logits, ``(onehot(target) - softmax) * scale`` (``scale`` ``[rows]``; None: 1), and 0 on rows without a
    target (whose logits may be non-finite)."""
    if scale is None:
        probs.neg_()
        probs.scatter_add_(1, target.clamp(min=0).unsqueeze(1), torch.ones_like(probs[:, :1]))
    else:
        probs.mul_(-scale.unsqueeze(1))
        probs.scatter_add_(1, target.clamp(min=0).unsqueeze(1), scale.unsqueeze(1))
    return probs.masked_fill_(~valid.unsqueeze(1), 0.0)


def _accumulate(grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor | None, dtype: torch.dtype,
                grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
                grad_bias: torch.Tensor | None) -> None:
    """Add one chunk's share to the gradient buffers, from ``grad`` (fp32 ``[rows, V]``, the gradient of its
    logits): its rows of ``grad_hidden`` (``grad @ W``, in the compute dtype, stored in the hidden states' dtype),
    and ``grad^T h`` / ``grad.sum(0)`` added to the fp32 ``grad_weight`` / ``grad_bias``."""
    if w is None:
        if grad_hidden is not None:
            grad_hidden.copy_(grad)  # half precision: rounded once, from fp32
        return
    grad = grad.to(dtype)
    if grad_hidden is not None:
        grad_hidden.copy_(grad @ w)
    if grad_weight is not None and dtype == torch.float32:
        grad_weight.addmm_(grad.t(), h)  # no [V, H] temporary
    elif grad_weight is not None:
        grad_weight.add_(grad.t() @ h)
    if grad_bias is not None:
        grad_bias.add_(grad.sum(0, dtype=torch.float32))


def _buffers(hidden: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, need_hidden: bool,
             need_weight: bool, need_bias: bool) -> tuple[torch.Tensor | None, ...]:
    """The gradient buffers: the hidden states' (their dtype and shape), the head's and the bias's (fp32)."""
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None)


class _LinearLogProbs(torch.autograd.Function):
    """``[S]`` sums of target log-probs over ``[N, H]`` hidden states and an optional ``[V, H]`` head; see the module
    docstring. Outputs the sums (fp32) and the argmax hits (long, not differentiable).

    ``grad_enabled`` (``torch.is_grad_enabled()`` at the call: a Function's forward always runs without grad mode, and
    its ``needs_input_grad`` does not say whether a graph is being recorded) selects the early-gradient path.

    ``temperature`` T: the log-probs are ``log_softmax(logits / T)``; the gradient with respect to the logits is then
    ``(onehot - softmax(logits / T)) / T``, so both paths compute ``g`` from the tempered softmax and divide the
    upstream gradient by T in backward (one ``[S]`` vector, not a ``[rows, V]`` chunk)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                targets: torch.Tensor, seq: torch.Tensor, sequences: int, rows: int, dtype: torch.dtype,
                count_hits: bool, grad_enabled: bool, temperature: float, divisor: float,
                softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        need_hidden, need_weight, need_bias = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        # early: the gradient pieces are computed now, from this softmax, when one scale per row finishes them (not
        # in fp16: its unscaled products would lose the small entries that the loss scale is there to keep)
        early = weight is not None and dtype != torch.float16 and (need_hidden or need_weight or need_bias) and \
            (sequences == 1 or not (need_weight or need_bias))
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype) if weight is not None else None
            b = bias.to(dtype) if bias is not None else None
            valid = targets != IGNORE
            # float64 accumulator: chunk sums add up in another order than one fused reduction would
            out = torch.zeros(sequences, dtype=torch.float64, device=hidden.device)
            hits = torch.zeros(sequences, dtype=torch.long, device=hidden.device)
            grad_hidden, grad_weight, grad_bias = _buffers(hidden, weight, bias, need_hidden, need_weight,
                                                           need_bias) if early else (None, None, None)
            for start in range(0, hidden.size(0), rows):
                end = start + rows
                h = hidden[start:end].to(dtype) if w is not None else hidden[start:end]
                logits = _chunk_logits(h, w, b)
                shaped = _shaped(logits, divisor, softcap, in_place=True)
                logp = torch.log_softmax(_tempered(shaped, temperature), dim=-1, dtype=torch.float32)
                out.index_add_(0, seq[start:end], _picked(logp, targets[start:end], valid[start:end]).double())
                if count_hits:  # an argmax pass over the chunk: eval's token accuracy only
                    hits.index_add_(0, seq[start:end], _hits(logits, targets[start:end], valid[start:end]))
                if early:  # softmax = exp(log-softmax), in place: logp is not needed any more
                    grad = _logit_grad(logp.exp_(), targets[start:end], valid[start:end])
                    factor = _softcap_factor(shaped, softcap)
                    _accumulate(grad if factor is None else grad.mul_(factor), h, w, dtype,
                                grad_hidden[start:end] if grad_hidden is not None else None, grad_weight, grad_bias)
        ctx.rows, ctx.dtype, ctx.sequences, ctx.early, ctx.temperature = rows, dtype, sequences, early, temperature
        ctx.divisor, ctx.softcap = divisor, softcap
        if early:  # the unscaled gradients: nothing else is needed (not the hidden states, not the weight)
            ctx.save_for_backward(seq, grad_hidden, grad_weight, grad_bias)
            ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, seq)
        ctx.mark_non_differentiable(hits)
        return out.to(torch.float32), hits

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_hits: Any) -> tuple[torch.Tensor | None, ...]:
        none = (None,) * 10
        upstream = grad_out.to(torch.float32)
        if ctx.temperature * ctx.divisor != 1.0:  # d(logits / T) / d(logits), and the divisor's share alike
            upstream = upstream / (ctx.temperature * ctx.divisor)
        if ctx.early:
            seq, grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
            if grad_hidden is not None:  # each row's sequence scale, one rounding to the hidden states' dtype
                grad_hidden = (grad_hidden * upstream.index_select(0, seq).unsqueeze(1)).to(grad_hidden.dtype)
            if grad_weight is not None:  # one sequence: its scale is the upstream gradient's only entry
                grad_weight = (grad_weight * upstream).to(ctx.dtypes[0])
            if grad_bias is not None:
                grad_bias = (grad_bias * upstream).to(ctx.dtypes[1])
            return (grad_hidden, grad_weight, grad_bias, *none)
        hidden, weight, bias, targets, seq = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(ctx.dtype) if weight is not None else None
            b = bias.to(ctx.dtype) if bias is not None else None
            valid = targets != IGNORE
            # d(sum of logp[target]) / d(logits) = (onehot(target) - softmax) * upstream gradient of the sequence
            scale = torch.where(valid, upstream.index_select(0, seq), 0.0)
            grad_hidden, grad_weight, grad_bias = _buffers(hidden, weight, bias, need_hidden, need_weight, need_bias)
            for start in range(0, hidden.size(0), ctx.rows):
                end = start + ctx.rows
                h = hidden[start:end].to(ctx.dtype) if w is not None else hidden[start:end]
                shaped = _shaped(_chunk_logits(h, w, b), ctx.divisor, ctx.softcap, in_place=True)
                probs = torch.softmax(_tempered(shaped, ctx.temperature), dim=-1, dtype=torch.float32)
                grad = _logit_grad(probs, targets[start:end], valid[start:end], scale[start:end])
                factor = _softcap_factor(shaped, ctx.softcap)
                _accumulate(grad if factor is None else grad.mul_(factor), h, w, ctx.dtype,
                            grad_hidden[start:end] if grad_hidden is not None else None, grad_weight, grad_bias)
        return (grad_hidden,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None,
                *none)


def _module_chunk(head: Any, hidden: torch.Tensor, targets: torch.Tensor, seq: torch.Tensor, sequences: int,
                  count_hits: bool, temperature: float = 1.0, divisor: float = 1.0,
                  softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk through a head module: its per-sequence log-prob sums (at ``temperature``, of the logits shaped
    as :func:`_shaped` says) and hits."""
    logits = head(hidden)
    valid = targets != IGNORE
    out = torch.zeros(sequences, dtype=torch.float32, device=hidden.device)
    hits = torch.zeros(sequences, dtype=torch.long, device=hidden.device)
    if count_hits:
        hits = hits.index_add(0, seq, _hits(logits, targets, valid))
    return out.index_add(0, seq, _pick(_shaped(logits, divisor, softcap), targets, valid, temperature)), hits


def _module_logprobs(head: Any, hidden: torch.Tensor, targets: torch.Tensor, seq: torch.Tensor, sequences: int,
                     rows: int, count_hits: bool, temperature: float = 1.0, divisor: float = 1.0,
                     softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logprobs` through any head module, one checkpointed chunk at a time (``split``, so the
    hidden states' gradient is assembled once, not zero-filled per chunk)."""
    from torch.utils.checkpoint import checkpoint  # lazy: heavy

    total = torch.zeros(sequences, dtype=torch.float32, device=hidden.device)
    hits = torch.zeros(sequences, dtype=torch.long, device=hidden.device)
    for h, t, s in zip(hidden.split(rows), targets.split(rows), seq.split(rows), strict=True):
        if torch.is_grad_enabled() and h.requires_grad:
            part, hit = checkpoint(_module_chunk, head, h, t, s, sequences, count_hits, temperature, divisor, softcap,
                                   use_reentrant=False)
        else:
            part, hit = _module_chunk(head, h, t, s, sequences, count_hits, temperature, divisor, softcap)
        total, hits = total + part, hits + hit
    return total, hits


def sequence_logprobs(hidden: torch.Tensor, targets: torch.Tensor, seq: torch.Tensor, sequences: int, *,
                      weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, head: Any = None,
                      chunk_rows: int | None = None, count_hits: bool = True, temperature: float = 1.0,
                      divisor: float = 1.0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the sum of ``log_softmax(logits / temperature)[target]`` over its rows whose target is not
    IGNORE, and the number of those rows whose argmax is the target; logits are never materialised beyond one chunk.

    ``hidden`` ``[N, H]``: final hidden states (or ``[N, V]`` logits when neither ``weight`` nor ``head`` is given);
    ``targets`` ``[N]``; ``seq`` ``[N]`` the sequence (``0..sequences-1``) of each row. The logits are
    ``hidden @ weight^T + bias`` (``weight`` ``[V, H]``), or ``head(hidden)`` for any other head module.
    Returns ``([S]`` fp32 with grad, ``[S]`` long; zeros without ``count_hits``, which saves an argmax pass per
    chunk in training). ``chunk_rows`` defaults to :func:`default_chunk_rows`. ``temperature`` (> 0; 1: the model's own
    distribution): the log-probs of a sampler at that temperature, which is what GRPO scores its completions with
    (:mod:`finetune.tasks.grpo`); the fp32 log-softmax then runs on ``logits / temperature``. ``divisor`` (> 0) and
    ``softcap`` (> 0 or None): the change a family's forward makes to its head's output, done to each chunk's logits
    first (``softcap * tanh(logits / divisor / softcap)``; see the module docstring)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or seq.shape != targets.shape:
        raise ValueError(f"expected hidden [N, H] with targets and seq [N], got {tuple(hidden.shape)}, "
                         f"{tuple(targets.shape)} and {tuple(seq.shape)}")
    if not hidden.is_floating_point():
        raise TypeError(f"hidden states / logits must be floating point, got {hidden.dtype}")
    if head is not None and weight is not None:
        raise ValueError("give a head module or a weight, not both")
    vocab = weight.size(0) if weight is not None else None
    if vocab is None:
        vocab = getattr(head, "out_features", None) if head is not None else hidden.size(1)
    rows = default_chunk_rows(vocab or hidden.size(1), hidden.device) if chunk_rows is None else chunk_rows
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not divisor > 0 or (softcap is not None and not softcap > 0):
        raise ValueError(f"divisor and softcap must be > 0, got {divisor} and {softcap}")
    targets, seq = targets.long(), seq.long()
    if head is not None:
        return _module_logprobs(head, hidden, targets, seq, sequences, rows, count_hits, temperature, divisor,
                                softcap)
    return _LinearLogProbs.apply(hidden, weight, bias, targets, seq, sequences, rows,
                                 compute_dtype(hidden, weight), count_hits, torch.is_grad_enabled(), temperature,
                                 float(divisor), None if softcap is None else float(softcap))


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Sum (fp32 scalar) of per-token cross-entropy over the targets that are not ``IGNORE``: minus
    :func:`sequence_logprobs` of one sequence over ``[..., V]`` logits (any float dtype) and ``[...]`` targets.

    Equal to ``F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE,
    reduction="sum")`` with one fp32 chunk alive at a time. For next-token loss, shift the labels rather than
    slicing the logits, e.g. ``F.pad(labels[:, 1:], (0, 1), value=IGNORE)``, so the logits stay contiguous."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}[:-1]")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    flat = targets.reshape(-1)
    seq = torch.zeros_like(flat, dtype=torch.long)
    sums, _ = sequence_logprobs(logits.reshape(-1, logits.size(-1)), flat, seq, 1, chunk_rows=chunk_rows,
                                count_hits=False)
    return -sums[0]
