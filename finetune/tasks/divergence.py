"""Divergences between a teacher's and a student's next-token distributions, per token (distillation's losses).

For student logits ``s`` and teacher logits ``t`` of one position, at temperature ``T``: ``p = softmax(t / T)`` (the
teacher), ``q = softmax(s / T)`` (the student), and

- ``forward_kl``: KL(p || q) = sum p (log p - log q), the student covering the teacher's mass;
- ``reverse_kl``: KL(q || p) = sum q (log q - log p), the student seeking the teacher's modes;
- ``jsd`` with ``beta`` in (0, 1): the generalized Jensen-Shannon divergence of GKD, with the mixture
  ``m = beta p + (1 - beta) q``: ``beta KL(p || m) + (1 - beta) KL(q || m)``. It tends to 0 at both ends; GKD's
  ``beta`` 0 and 1 are the forward and the reverse KL, so those are ``forward_kl`` and ``reverse_kl`` here.

``top_k``: both distributions are restricted to the teacher's ``k`` most likely tokens at each position and each
renormalized over those ``k`` (a teacher stored or sent as its top-k log-probs), then compared as above.

Each function returns the divergence of every position (``[...]``, the logits' leading shape), in fp32, so a loss
sums them over the target tokens (token-weighted over the window and the ranks, as every loss of finetune): ``task:
distill`` computes them chunk by chunk (:mod:`finetune.tasks.chunked_divergence`).
"""

from __future__ import annotations

import math

import torch

LOSSES = ("forward_kl", "reverse_kl", "jsd")


def log_probs(teacher: torch.Tensor, student: torch.Tensor, temperature: float = 1.0, top_k: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's and the student's log-probabilities at ``temperature`` (fp32), over the whole vocabulary or,
    with ``top_k``, over the teacher's ``top_k`` most likely tokens, each renormalized there."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    teacher, student = teacher.float() / temperature, student.float() / temperature
    if top_k is not None:
        if not 0 < top_k <= teacher.size(-1):
            raise ValueError(f"top_k must be in 1..{teacher.size(-1)}, got {top_k}")
        kept = teacher.topk(top_k, dim=-1).indices
        teacher, student = teacher.gather(-1, kept), student.gather(-1, kept)
    return teacher.log_softmax(-1), student.log_softmax(-1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per position, from log-probabilities (a term where a is 0 adds nothing)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def divergence(teacher: torch.Tensor, student: torch.Tensor, loss: str = "forward_kl", *, beta: float = 0.5,
               temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """The per-position divergence ``loss`` (one of :data:`LOSSES`) between the teacher's and the student's
    distributions of logits ``teacher`` and ``student`` (see the module docstring)."""
    return divergence_of(*log_probs(teacher, student, temperature, top_k), loss, beta=beta)


def divergence_of(log_p: torch.Tensor, log_q: torch.Tensor, loss: str = "forward_kl", *,
                  beta: float = 0.5) -> torch.Tensor:
    """:func:`divergence` from the teacher's and the student's log-probabilities as :func:`log_probs` gives them."""
    if loss == "forward_kl":
        return _kl(log_p, log_q)
    if loss == "reverse_kl":
        return _kl(log_q, log_p)
    if loss == "jsd":
        if not 0 < beta < 1:
            raise ValueError(f"jsd needs beta in (0, 1), got {beta} (0 and 1 are forward_kl and reverse_kl)")
        log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
        return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    raise ValueError(f"unknown divergence {loss!r}; use one of {', '.join(LOSSES)}")
