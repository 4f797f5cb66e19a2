"""Distillation's loss over a batch, chunk by chunk: no ``[tokens x vocab]`` logits for either model.

The student's final hidden states ``[N, Hs]`` and the teacher's ``[N, Ht]`` (the same positions of the same
sequences) go through their output heads one fixed chunk of rows at a time: the chunk's student and teacher logits,
each shaped as its family's forward shapes them (Granite's division, Gemma's soft-cap), then per row

    loss = (1 - alpha) x divergence(teacher, student) + alpha x cross-entropy(student, target)

with the divergence of :mod:`finetune.tasks.divergence` (forward / reverse KL, generalized JSD, at a temperature,
optionally over the teacher's top-k), summed over the rows whose target is not IGNORE. The batch's result is that
sum (the loop divides once by the window's targets: token-weighted over the window and the ranks) and, detached,
the sums behind the metrics: the divergence, the student's and the teacher's negative log-likelihood of the targets
and the student's argmax hits.

Gradients: for a plain ``nn.Linear`` student head (tied or not) the gradient of the chunk's loss with respect to
its logits is taken in forward, by autograd over the chunk alone (the divergence's own formula differentiated, no
hand-written derivative), while the chunk's logits exist; ``g @ W`` goes into an ``[N, Hs]`` buffer for the hidden
states and ``g^T h`` into one fp32 ``[V, Hs]`` buffer for the head, as the SFT loss's early path does
(:mod:`finetune.tasks.losses`). Backward multiplies them by the upstream gradient; nothing of the teacher is needed
then, so a sharded teacher's gathered weights may be released right after its forward. Any other student head (a
LoRA-adapted one) is called per chunk under activation checkpointing: the teacher's chunk logits are recomputed in
backward from its hidden states and head weight, which the caller keeps alive until then.

Memory: besides the buffers, one chunk's student and teacher logits and the divergence's fp32 temporaries (a few
``rows x V`` tensors): :func:`chunk_rows` takes a quarter of the SFT loss's chunk for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from finetune.data.rows import IGNORE
from finetune.tasks.divergence import divergence_of, log_probs
from finetune.tasks.losses import _accumulate, _buffers, _shaped, compute_dtype, default_chunk_rows

STATS = ("divergence", "student_nll", "teacher_nll", "hits")  # the detached sums, in this order


@dataclass(frozen=True)
class Rule:
    """What the loss compares (the recipe's ``distill`` section): the divergence ``loss``, jsd's ``beta``, the
    ``temperature``, the teacher's ``top_k`` (None: the whole vocabulary) and the cross-entropy weight ``alpha``."""

    loss: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    top_k: int | None = None
    alpha: float = 0.0

    @classmethod
    def of(cls, distill: Any) -> Rule:
        """The rule of a recipe's ``distill`` section."""
        return cls(distill.loss, distill.beta, distill.temperature, distill.top_k, distill.alpha)


@dataclass
class Side:
    """One model's share of a chunk: its final hidden states ``[N, H]`` and its head (``weight`` ``[V, H]`` and
    ``bias``; no weight: ``hidden`` already holds logits), and what its family's forward does to the head's output
    (``divisor``, ``softcap``)."""

    hidden: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    divisor: float = 1.0
    softcap: float | None = None

    def logits(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 shaped logits of rows ``[start, end)``, the head's matmul in ``dtype`` (no autograd)."""
        h = self.hidden[start:end]
        if self.weight is not None:
            bias = self.bias.to(dtype) if self.bias is not None else None
            h = torch.nn.functional.linear(h.to(dtype), self.weight.to(dtype), bias)
        return _shaped(h.float(), self.divisor, self.softcap)


def chunk_rows(vocab_size: int, device: torch.device | str) -> int:
    """Rows per chunk: a quarter of the SFT loss's (:func:`finetune.tasks.losses.default_chunk_rows`), for the two
    models' logits and the divergence's temporaries."""
    return max(1, default_chunk_rows(vocab_size, device) // 4)


def chunk_terms(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, rule: Rule,
                divisor: float = 1.0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's loss sum (differentiable in ``student``, the raw fp32 logits of the student's head) and its
    detached :data:`STATS` sums; ``teacher``: the teacher's shaped fp32 logits; ``divisor`` and ``softcap``: the
    student family's shaping, done here so that autograd differentiates it too."""
    valid = targets != IGNORE
    shaped = _shaped(student, divisor, softcap)
    log_p, log_q = log_probs(teacher, shaped, rule.temperature, rule.top_k)
    div = divergence_of(log_p, log_q, rule.loss, beta=rule.beta)
    # the log-likelihoods are at temperature 1 over the whole vocabulary: the divergence's own log-probs when its
    # are those (the default), not a second log-softmax of each model's chunk
    whole = rule.temperature == 1.0 and rule.top_k is None
    picked = targets.clamp(min=0).unsqueeze(1)
    student_nll = -(log_q if whole else shaped.log_softmax(-1)).gather(1, picked).squeeze(1)
    teacher_nll = -(log_p if whole else teacher.log_softmax(-1)).gather(1, picked).squeeze(1)
    per_row = (1.0 - rule.alpha) * div + rule.alpha * student_nll if rule.alpha else div
    loss = torch.where(valid, per_row, 0.0).sum()
    hits = (shaped.argmax(-1) == targets) & valid
    stats = torch.stack([torch.where(valid, value.detach(), 0.0).double().sum()
                         for value in (div, student_nll, teacher_nll, hits.double())])
    return loss, stats


class _FusedDistill(torch.autograd.Function):
    """The loss sum and the :data:`STATS` over ``[N, Hs]`` student hidden states with a plain linear head; the
    gradient is taken chunk by chunk in forward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, teacher: Side,
                targets: torch.Tensor, rule: Rule, rows: int, dtype: torch.dtype, teacher_dtype: torch.dtype,
                grad_enabled: bool, divisor: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        need_hidden, need_weight, need_bias = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        early = need_hidden or need_weight or need_bias
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        stats = torch.zeros(len(STATS), dtype=torch.float64, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            grad_hidden, grad_weight, grad_bias = _buffers(hidden, weight, bias, need_hidden, need_weight,
                                                           need_bias) if early else (None, None, None)
            for start in range(0, hidden.size(0), rows):
                end = min(start + rows, hidden.size(0))
                h = hidden[start:end].to(dtype)
                logits = torch.nn.functional.linear(h, w, b).float()
                taught = teacher.logits(start, end, teacher_dtype)
                chunk_targets = targets[start:end]
                if early:
                    with torch.enable_grad():
                        leaf = logits.detach().requires_grad_(True)
                        loss, part = chunk_terms(leaf, taught, chunk_targets, rule, divisor, softcap)
                        (grad,) = torch.autograd.grad(loss, leaf)
                    grad = grad.masked_fill_((chunk_targets == IGNORE).unsqueeze(1), 0.0)  # a row's non-finite logits
                    _accumulate(grad, h, w, dtype, grad_hidden[start:end] if grad_hidden is not None else None,
                                grad_weight, grad_bias)
                else:
                    loss, part = chunk_terms(logits, taught, chunk_targets, rule, divisor, softcap)
                total += loss.detach().double()
                stats += part
        ctx.early = early
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(stats)
        return total.to(torch.float32), stats

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_stats: Any) -> tuple[torch.Tensor | None, ...]:
        none = (None,) * 9
        if not ctx.early:
            return (None, None, None, *none)
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        upstream = grad_out.to(torch.float32)
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * upstream).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * upstream).to(ctx.dtypes[0])
        if grad_bias is not None:
            grad_bias = (grad_bias * upstream).to(ctx.dtypes[1])
        return (grad_hidden, grad_weight, grad_bias, *none)


def _module_chunk(head: Any, hidden: torch.Tensor, teacher: Side, start: int, end: int, targets: torch.Tensor,
                  rule: Rule, teacher_dtype: torch.dtype, divisor: float,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk through a student head module (or, with no head, ``hidden`` as the logits)."""
    logits = head(hidden) if head is not None else hidden
    return chunk_terms(logits.float(), teacher.logits(start, end, teacher_dtype), targets, rule, divisor, softcap)


def distill_sums(hidden: torch.Tensor, targets: torch.Tensor, teacher: Side, rule: Rule, *,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, head: Any = None,
                 divisor: float = 1.0, softcap: float | None = None,
                 rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss sum (0-d fp32, with grad) and the detached :data:`STATS` sums (fp64 ``[4]``) of the student's
    ``hidden`` ``[N, Hs]`` against ``teacher`` at next-token ``targets`` ``[N]`` (IGNORE: not counted).

    The student's logits are ``hidden @ weight^T + bias`` (the fused path), ``head(hidden)`` for any other head
    module, or ``hidden`` itself when neither is given; ``divisor`` and ``softcap``: its family's shaping of them.
    ``rows``: rows per chunk (default :func:`chunk_rows`)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or teacher.hidden.shape[:1] != targets.shape:
        raise ValueError(f"expected student and teacher states [N, H] and targets [N], got {tuple(hidden.shape)}, "
                         f"{tuple(teacher.hidden.shape)} and {tuple(targets.shape)}")
    vocab = weight.size(0) if weight is not None else getattr(head, "out_features", None) or hidden.size(1)
    rows = chunk_rows(vocab, hidden.device) if rows is None else rows
    teacher_dtype = compute_dtype(teacher.hidden, teacher.weight)
    targets = targets.long()
    if weight is not None:
        return _FusedDistill.apply(hidden, weight, bias, teacher, targets, rule, rows,
                                   compute_dtype(hidden, weight), teacher_dtype, torch.is_grad_enabled(),
                                   float(divisor), None if softcap is None else float(softcap))
    from torch.utils.checkpoint import checkpoint  # lazy: heavy

    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    stats = torch.zeros(len(STATS), dtype=torch.float64, device=hidden.device)
    for start in range(0, hidden.size(0), rows):
        end = min(start + rows, hidden.size(0))
        args = (head, hidden[start:end], teacher, start, end, targets[start:end], rule, teacher_dtype, divisor,
                softcap)
        if torch.is_grad_enabled() and hidden.requires_grad:
            loss, part = checkpoint(_module_chunk, *args, use_reentrant=False)
        else:
            loss, part = _module_chunk(*args)
        total, stats = total + loss, stats + part
    return total, stats
