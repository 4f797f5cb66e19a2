"""The DPO task on a tiny Llama built from a config (forward/backward only, no optimizer steps).

Checks the chunked per-sequence log-probs against a plain fp64 log-softmax (value and gradient), the pair losses
against their formulas, what the task counts and sums, that ipo uses per-token averages, and that the reference
pass gives bit-identical values on 1, 2 and 3 (simulated) processes.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from finetune.data import DataBundle
from finetune.data.batching import PreferenceCollator
from finetune.data.tokenize import IGNORE, tokenize_rows
from finetune.tasks.dpo import (
    DPOTask,
    pair_losses,
    policy_logps,
    reference_schedule,
    reference_values,
    sequence_logps,
    unstride,
)
from finetune.tasks.logprobs import next_token_targets

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"
PAIRS = REPO / "recipes" / "data" / "reverse_pref_eval.jsonl"


def make_cfg(loss: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0, batch_size: int = 4) -> Any:
    """The few recipe fields the DPO task reads."""
    return SimpleNamespace(
        dpo=SimpleNamespace(beta=beta, label_smoothing=label_smoothing, loss=loss),
        eval=SimpleNamespace(metrics=["preference_accuracy"], batch_size=batch_size),
        train=SimpleNamespace(global_batch_size=4, micro_batch_size=2, seed=0),
        data=SimpleNamespace(shuffle=True, packing=False),
    )


@pytest.fixture(scope="module")
def dpo_pairs() -> datasets.Dataset:
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    raw = datasets.load_dataset("json", data_files=str(PAIRS), split="train").select(range(11))
    return tokenize_rows(raw, fmt="preference", tokenizer=tok, max_len=64, overlong="truncate", add_bos="auto").dataset


def naive_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The straightforward fp64 reference: a full log-softmax, gathered and summed per sequence."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != IGNORE, picked, 0.0).sum(-1)


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, None])
def test_sequence_logps_equal_a_full_log_softmax_value_and_gradient(chunk_rows: int | None) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 9, 33, requires_grad=True)
    labels = torch.randint(0, 33, (4, 9))
    labels[0, :4] = IGNORE  # a prompt
    labels[2, 6:] = IGNORE  # padding
    labels[3, :] = IGNORE  # a sequence with no target at all
    targets = next_token_targets(labels)
    weights = torch.tensor([0.5, -2.0, 1.5, 3.0])  # a different upstream gradient per sequence
    got = sequence_logps(logits, targets, chunk_rows=chunk_rows)
    (got * weights).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    expected = naive_logps(logits, targets)
    (expected * weights.double()).sum().backward()
    assert got.dtype == torch.float32 and got[3] == 0
    torch.testing.assert_close(got.double(), expected.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, logits.grad.float(), rtol=1e-5, atol=1e-6)


def test_sequence_logps_of_bf16_logits_keep_the_dtype_of_the_gradient() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 17).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 17, (2, 5))
    got = sequence_logps(logits, targets, chunk_rows=2)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), naive_logps(logits.detach().float(), targets), rtol=1e-5, atol=1e-4)


def test_pair_losses_follow_their_formulas() -> None:
    h = torch.tensor([-3.0, 0.0, 0.5, 4.0])
    beta = 0.2
    assert torch.allclose(pair_losses(h, beta), -F.logsigmoid(beta * h))
    assert pair_losses(torch.zeros(1), beta).item() == pytest.approx(math.log(2))
    ls = 0.1
    expected = -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)
    assert torch.allclose(pair_losses(h, beta, ls), expected)
    assert torch.allclose(pair_losses(h, beta, kind="ipo"), (h - 1 / (2 * beta)) ** 2)
    with pytest.raises(ValueError, match="unknown dpo loss"):
        pair_losses(h, beta, kind="hinge")


def _task(pairs: datasets.Dataset, **cfg: Any) -> DPOTask:
    data = DataBundle(SimpleNamespace(dataset=pairs), SimpleNamespace(dataset=pairs), None)  # type: ignore[arg-type]
    return DPOTask(make_cfg(**cfg), data, 0, 0, 1)


def _batch(pairs: datasets.Dataset, ref: torch.Tensor | None, rows: tuple[int, ...] = (0, 1, 2)) -> dict[str, Any]:
    items = [dict(pairs[i]) for i in rows]
    if ref is not None:
        for i, item in enumerate(items):
            item["ref_logps"] = [float(ref[i]), float(ref[len(rows) + i])]
    return PreferenceCollator(0)(items)


def test_against_itself_every_pair_costs_log2_and_no_pair_is_won(llama: Any, dpo_pairs: datasets.Dataset) -> None:
    """The reference is the policy: h is exactly 0, the sigmoid loss log 2 per pair, and no pair counts as correct
    (ties lose); the task counts pairs and sums their losses."""
    task = _task(dpo_pairs)
    with torch.no_grad():
        ref = policy_logps(llama, _batch(dpo_pairs, None))[0]
        batch = _batch(dpo_pairs, ref)
        assert task.count_targets(batch) == 3
        loss = task.train_output(llama, batch)
        counts = task.eval_output(llama, batch)
    assert loss.item() == pytest.approx(3 * math.log(2), rel=1e-6)
    assert counts.loss_sum.item() == pytest.approx(3 * math.log(2), rel=1e-6) and int(counts.num_tokens) == 3
    assert int(counts.correct["preference_accuracy"]) == 0 and int(counts.total["preference_accuracy"]) == 3
    assert counts.means["reward_margin"][0].item() == 0
    assert counts.means["logps_chosen"][0].item() == pytest.approx(float(ref[:3].sum()), rel=1e-6)
    assert counts.means["logps_rejected"][0].item() == pytest.approx(float(ref[3:].sum()), rel=1e-6)


def test_h_is_the_log_ratio_difference_and_accuracy_counts_its_sign(llama: Any, dpo_pairs: datasets.Dataset) -> None:
    beta = 0.5
    task = _task(dpo_pairs, beta=beta)
    with torch.no_grad():
        policy = policy_logps(llama, _batch(dpo_pairs, None))[0]
        shift = torch.tensor([1.0, -2.0, 0.5, 0.0, 0.0, 0.0])  # lower reference for chosen 0 and 2: those pairs win
        counts = task.eval_output(llama, _batch(dpo_pairs, policy - shift))
    h = shift[:3] - shift[3:]
    assert int(counts.correct["preference_accuracy"]) == 2
    assert counts.loss_sum.item() == pytest.approx(float(-F.logsigmoid(beta * h).sum()), rel=1e-5)
    assert counts.means["reward_margin"][0].item() == pytest.approx(float(beta * h.sum()), rel=1e-5)


def test_ipo_uses_per_token_averages(llama: Any, dpo_pairs: datasets.Dataset) -> None:
    beta = 0.1
    task = _task(dpo_pairs, loss="ipo", beta=beta)
    rows = (0, 8, 9)  # answers of 3, 5 and 4 letters
    batch = _batch(dpo_pairs, None, rows)
    with torch.no_grad():
        logps, tokens = policy_logps(llama, batch)
        ref = logps - torch.tensor([0.3, 0.1, -0.2, 0.0, 0.4, 0.2])
        loss = task.train_output(llama, _batch(dpo_pairs, ref, rows))
    avg = (logps - ref) / tokens
    h = avg[:3] - avg[3:]
    assert torch.equal(tokens, (next_token_targets(batch["labels"]) != IGNORE).sum(1))
    assert len(set(tokens.tolist())) > 1  # the averaging is visible: answers differ in length
    assert loss.item() == pytest.approx(float(((h - 1 / (2 * beta)) ** 2).sum()), rel=1e-5)


def test_the_train_loss_has_the_gradient_of_a_plain_implementation(llama: Any, dpo_pairs: datasets.Dataset) -> None:
    """Chunked log-probs through the task = autograd through a full fp64 log-softmax (per-parameter gradients)."""
    beta = 0.3
    task = _task(dpo_pairs, beta=beta)
    with torch.no_grad():
        ref = policy_logps(llama, _batch(dpo_pairs, None))[0] - 0.25
    batch = _batch(dpo_pairs, ref)
    llama.zero_grad()
    task.train_output(llama, batch).backward()
    got = {n: p.grad.clone() for n, p in llama.named_parameters()}
    llama.zero_grad()
    logits = llama(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = naive_logps(logits, next_token_targets(batch["labels"]))
    ratios = logps - ref.double()
    (-F.logsigmoid(beta * (ratios[:3] - ratios[3:]))).sum().backward()
    for name, param in llama.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    llama.zero_grad()


@pytest.mark.parametrize("size,batch", [(11, 4), (8, 4), (3, 5), (1, 1)])
def test_the_reference_schedule_covers_every_pair_once_in_fixed_batches(size: int, batch: int) -> None:
    fixed = [(j * batch, min((j + 1) * batch, size)) for j in range(math.ceil(size / batch))]
    for world in (1, 2, 3):
        schedules = [reference_schedule(size, batch, rank, world) for rank in range(world)]
        assert len({len(s) for s in schedules}) == 1  # lockstep: the same number of forward passes on every rank
        spans = [span for s in schedules for span in s if span is not None]
        assert sorted(spans) == fixed  # the same batches, whatever the world size


def test_reference_values_are_bit_identical_on_1_2_and_3_processes(llama: Any, dpo_pairs: datasets.Dataset) -> None:
    """Each simulated rank runs its schedule; concatenating the ranks' results (what all-gather does) and putting
    them in order gives exactly the values of one process, including fillers' positions."""
    collate = PreferenceCollator(0)

    def score(batch: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            return policy_logps(llama, batch)[0]

    results = {}
    for world in (1, 2, 3):
        parts = [reference_values(dpo_pairs, score, collate, 4, rank, world, torch.device("cpu"))
                 for rank in range(world)]
        results[world] = unstride(torch.cat(parts), len(dpo_pairs), world)
    assert results[1].shape == (len(dpo_pairs), 2)
    assert torch.equal(results[1], results[2]) and torch.equal(results[1], results[3])
    alone = score(collate([dict(dpo_pairs[i]) for i in range(4, 8)]))  # batch 1 scored on its own
    assert torch.equal(results[1][4:8, 0], alone[:4]) and torch.equal(results[1][4:8, 1], alone[4:])
    assert (results[1] < 0).all()  # every pair was scored (a log-prob sum of at least one token is negative)
