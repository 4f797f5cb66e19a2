"""finetune.tasks.chunked_divergence against the loss written plainly over whole logits with torch's own KL
(``F.kl_div``) and cross-entropy (``F.cross_entropy``), differentiated by autograd through the whole logits: the loss
sum, its gradients with respect to the hidden states, the head's weight and bias, and the metric sums, for every
divergence, a temperature, top-k, the cross-entropy mix, a family's shaping of the logits, ignored targets, several
chunks, and a head that is not a plain Linear (a LoRA-like module: the checkpointed path)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from finetune.data.rows import IGNORE
from finetune.tasks.chunked_divergence import Rule, Side, distill_sums

N, H, HT, V = 13, 8, 12, 29


def plain_divergence(t: torch.Tensor, s: torch.Tensor, rule: Rule) -> torch.Tensor:
    """Per row, with torch's F.kl_div (``kl_div(input=log q, target=log p, log_target=True)`` = KL(p || q))."""
    t, s = t / rule.temperature, s / rule.temperature
    if rule.top_k is not None:
        kept = t.topk(rule.top_k, dim=-1).indices
        t, s = t.gather(-1, kept), s.gather(-1, kept)
    log_p, log_q = t.log_softmax(-1), s.log_softmax(-1)

    def kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:  # KL(a || b) per row
        return F.kl_div(log_b, log_a, reduction="none", log_target=True).sum(-1)

    if rule.loss == "forward_kl":
        return kl(log_p, log_q)
    if rule.loss == "reverse_kl":
        return kl(log_q, log_p)
    log_m = (rule.beta * log_p.exp() + (1 - rule.beta) * log_q.exp()).log()
    return rule.beta * kl(log_p, log_m) + (1 - rule.beta) * kl(log_q, log_m)


def shape(logits: torch.Tensor, divisor: float, softcap: float | None) -> torch.Tensor:
    logits = logits / divisor
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[0, 5, 6]] = IGNORE
    return {"hidden": torch.randn(N, H, generator=g, dtype=torch.float64).float(),
            "weight": torch.randn(V, H, generator=g) * 0.7, "bias": torch.randn(V, generator=g) * 0.1,
            "t_hidden": torch.randn(N, HT, generator=g), "t_weight": torch.randn(V, HT, generator=g) * 0.7,
            "targets": targets}


CASES = {
    "forward_kl": (Rule("forward_kl"), 1.0, None),
    "reverse_kl": (Rule("reverse_kl"), 1.0, None),
    "jsd_0.1": (Rule("jsd", beta=0.1), 1.0, None),
    "jsd_0.5_hot": (Rule("jsd", beta=0.5, temperature=2.0), 1.0, None),
    "forward_topk": (Rule("forward_kl", top_k=5), 1.0, None),
    "reverse_cold_topk": (Rule("reverse_kl", temperature=0.7, top_k=3), 1.0, None),
    "alpha": (Rule("forward_kl", alpha=0.3, temperature=1.5), 1.0, None),
    "shaped": (Rule("reverse_kl", alpha=0.2), 2.0, 3.0),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [4, 64])
def test_fused_path_matches_the_loss_over_whole_logits(case: str, rows: int) -> None:
    rule, divisor, softcap = CASES[case]
    d = data()
    teacher = Side(d["t_hidden"], d["t_weight"], divisor=divisor, softcap=softcap)
    hidden, weight, bias = (d[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    loss, stats = distill_sums(hidden, d["targets"], teacher, rule, weight=weight, bias=bias, divisor=divisor,
                               softcap=softcap, rows=rows)
    loss.backward()

    ref_h, ref_w, ref_b = (d[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    student = shape(ref_h @ ref_w.T + ref_b, divisor, softcap)
    taught = shape(d["t_hidden"] @ d["t_weight"].T, divisor, softcap)
    valid = d["targets"] != IGNORE
    div = plain_divergence(taught, student, rule)
    ce = F.cross_entropy(student, d["targets"], ignore_index=IGNORE, reduction="none")
    per_row = (1 - rule.alpha) * div + rule.alpha * ce
    reference = per_row[valid].sum()
    reference.backward()

    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    for mine, theirs in ((hidden, ref_h), (weight, ref_w), (bias, ref_b)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6)
    teacher_ce = F.cross_entropy(taught, d["targets"], ignore_index=IGNORE, reduction="sum")
    hits = ((student.argmax(-1) == d["targets"]) & valid).sum()
    expected = [div[valid].sum().item(), ce[valid].sum().item(), teacher_ce.item(), float(hits)]
    assert stats.tolist() == pytest.approx(expected, rel=1e-5)
    assert all(math.isfinite(x) for x in stats.tolist())


class LoraLikeHead(torch.nn.Module):
    """A head that is not a plain Linear: a base weight plus a low-rank update (the checkpointed per-chunk path)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.base = torch.nn.Linear(H, V)
        with torch.no_grad():
            self.base.weight.copy_(weight)
            self.base.bias.copy_(bias)
        self.a = torch.nn.Parameter(torch.randn(2, H, generator=torch.Generator().manual_seed(3)) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(V, 2, generator=torch.Generator().manual_seed(4)) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.T @ self.b.T


def test_module_head_path_matches_the_loss_over_whole_logits() -> None:
    rule = Rule("jsd", beta=0.3, temperature=1.3, top_k=7)
    d = data(1)
    teacher = Side(d["t_hidden"], d["t_weight"])
    head = LoraLikeHead(d["weight"], d["bias"])
    hidden = d["hidden"].clone().requires_grad_(True)
    loss, _ = distill_sums(hidden, d["targets"], teacher, rule, head=head, rows=5)
    loss.backward()
    mine = [hidden.grad, head.a.grad, head.b.grad]
    head.zero_grad()
    ref_h = d["hidden"].clone().requires_grad_(True)
    valid = d["targets"] != IGNORE
    reference = plain_divergence(d["t_hidden"] @ d["t_weight"].T, head(ref_h), rule)[valid].sum()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    for a, b in zip(mine, [ref_h.grad, head.a.grad, head.b.grad], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_no_grad_gives_the_same_sums_and_an_identical_teacher_gives_zero() -> None:
    """Eval (no gradient) computes the same loss; a teacher that is the student has divergence 0 (every loss)."""
    d = data(2)
    teacher = Side(d["t_hidden"], d["t_weight"])
    with_grad, _ = distill_sums(d["hidden"].requires_grad_(True), d["targets"], teacher, Rule(), weight=d["weight"])
    with torch.no_grad():
        without, _ = distill_sums(d["hidden"], d["targets"], teacher, Rule(), weight=d["weight"])
    assert without.item() == pytest.approx(with_grad.item(), rel=1e-6)
    itself = Side(d["hidden"], d["weight"])
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        value, stats = distill_sums(d["hidden"].detach(), d["targets"], itself, Rule(loss), weight=d["weight"])
        assert value.item() == pytest.approx(0.0, abs=1e-5) and stats[1].item() == pytest.approx(stats[2].item())
