"""finetune.tasks.divergence: each divergence against its formula written plainly here, in float64 with Python
sums over explicit probabilities (forward and reverse KL, generalized JSD with its beta, temperature, top-k
renormalization), on random logits."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.tasks.divergence import divergence


def softmax(row: list[float], temperature: float) -> list[float]:
    top = max(row)
    weights = [math.exp((x - top) / temperature) for x in row]
    return [w / sum(weights) for w in weights]


def kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True) if x > 0)


def plain(teacher: list[float], student: list[float], loss: str, beta: float, temperature: float,
          top_k: int | None) -> float:
    """The definition: restrict to the teacher's top_k logits (renormalizing), soften by temperature, compare."""
    if top_k is not None:
        kept = sorted(range(len(teacher)), key=lambda i: -teacher[i])[:top_k]
        teacher, student = [teacher[i] for i in kept], [student[i] for i in kept]
    p, q = softmax(teacher, temperature), softmax(student, temperature)
    if loss == "forward_kl":
        return kl(p, q)
    if loss == "reverse_kl":
        return kl(q, p)
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q, strict=True)]
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.1), ("jsd", 0.5),
                                       ("jsd", 0.9)])
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("top_k", [None, 1, 5])
def test_each_divergence_is_its_formula(loss: str, beta: float, temperature: float, top_k: int | None) -> None:
    generator = torch.Generator().manual_seed(0)
    teacher, student = (torch.randn(2, 3, 17, generator=generator, dtype=torch.float64) * 3 for _ in range(2))
    got = divergence(teacher, student, loss, beta=beta, temperature=temperature, top_k=top_k)
    assert got.shape == (2, 3) and got.dtype == torch.float32
    want = [[plain(teacher[i, j].tolist(), student[i, j].tolist(), loss, beta, temperature, top_k)
             for j in range(3)] for i in range(2)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_a_student_equal_to_its_teacher_diverges_by_nothing_and_mistakes_are_refused() -> None:
    logits = torch.randn(4, 11)
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        assert divergence(logits, logits.clone(), loss).abs().max() < 1e-6
    assert divergence(logits, logits, "forward_kl", top_k=1).abs().max() == 0  # one token: nothing to compare
    for kwargs, needle in (({"loss": "jsd", "beta": 0.0}, "beta in \\(0, 1\\)"), ({"loss": "kl"}, "unknown"),
                           ({"temperature": 0.0}, "temperature"), ({"top_k": 12}, "top_k must be in 1..11")):
        with pytest.raises(ValueError, match=needle):
            divergence(logits, logits, **kwargs)
