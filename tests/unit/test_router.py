"""finetune.tasks.router: a mixture-of-experts model's router load-balancing loss in the SFT loss, weighted by each
micro-batch's targets, logged as ``aux_loss``, and the train.log line that says whether it is on.

Checked against transformers' own loss: a micro-batch's ``train_output`` / targets equals the model's ``loss`` given
labels (mean cross-entropy + router_aux_loss_coef x aux_loss), for every MoE row (forward passes only). The loop's
accumulation and ranks: tests/integration/test_moe.py and tests/distributed/test_registry.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import datasets
import pytest
import torch

from finetune.data.batching import Collator
from finetune.data.tokenize import IGNORE, tokenize_rows
from finetune.errors import ConfigError
from finetune.registry import SUPPORTED_MODELS
from finetune.tasks import router
from finetune.tasks.causal_lm import CausalLMTask
from tests.moe_rows import MOE_ROWS, tiny_model
from tests.task_config import make_cfg

ROWS = [
    {"instruction": "Reverse the letters.", "input": "d a c z", "output": "z c a d"},
    {"instruction": "Reverse the letters.", "input": "b v w c d e f", "output": "f e d c w v b"},
    {"instruction": "Say hi.", "input": "", "output": "hi"},
]


@pytest.fixture(scope="module")
def padded_alpaca(tok: Any) -> dict[str, Any]:
    """Three alpaca rows of different lengths, padded (so the model's aux loss has padding to leave out)."""
    data = tokenize_rows(datasets.Dataset.from_list(ROWS), fmt="alpaca", tokenizer=tok, max_len=64,
                         overlong="truncate", add_bos="auto").dataset
    return Collator(pad_id=0)(list(data))


@pytest.mark.parametrize("name", MOE_ROWS)
def test_one_micro_batch_trains_the_models_own_loss(name: str, padded_alpaca: dict[str, Any], tok: Any) -> None:
    """The summed loss / targets of one micro-batch is transformers' loss given labels (cross-entropy + coef x
    aux_loss), with the same gradient; and the aux term is really there (the loss without it differs)."""
    model = tiny_model(name).train()
    task = CausalLMTask(make_cfg(), None, 0, 0, 1, tokenizer=tok, row=SUPPORTED_MODELS[name])
    targets = task.count_targets(padded_alpaca)
    ours = task.train_output(model, padded_alpaca) / targets
    ours.backward()
    ours_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    inputs = {"input_ids": padded_alpaca["input_ids"], "attention_mask": padded_alpaca["attention_mask"]}
    theirs = model(**inputs, labels=padded_alpaca["labels"]).loss
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    for key, grad in ours_grad.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[key].grad, rtol=1e-5, atol=1e-7)
    router_weights = [n for n in ours_grad if n.endswith(("gate.weight", "router.weight"))]
    assert router_weights and all(ours_grad[n].abs().sum() > 0 for n in router_weights)
    with torch.no_grad():
        plain = model(**inputs, labels=padded_alpaca["labels"], output_router_logits=False).loss
        aux = model(**inputs).aux_loss
    coef = model.config.router_aux_loss_coef
    torch.testing.assert_close(theirs.detach(), plain + coef * aux, rtol=1e-6, atol=1e-6)
    assert float(coef * aux) > 1e-3  # big enough that the first check would see it missing
    assert task.step_metrics(lambda sums: sums) == pytest.approx({"aux_loss": float(aux)}, rel=1e-6)
    assert int((padded_alpaca["labels"][:, 1:] != IGNORE).sum()) == targets


def test_a_dense_model_adds_nothing_and_reduces_nothing(llama: Any, padded_alpaca: dict[str, Any], tok: Any) -> None:
    """A model without a router: the loss is the cross-entropy sum alone, and the step has no metric and no
    collective."""
    task = CausalLMTask(make_cfg(), None, 0, 0, 1, tokenizer=tok)
    with torch.no_grad():
        loss = task.train_output(llama, padded_alpaca)
        hf = llama(input_ids=padded_alpaca["input_ids"], attention_mask=padded_alpaca["attention_mask"],
                   labels=padded_alpaca["labels"]).loss
    torch.testing.assert_close(loss / task.count_targets(padded_alpaca), hf, rtol=1e-6, atol=1e-6)

    def reduce(sums: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a dense model's step needs no collective")

    assert task.step_metrics(reduce) == {}


def test_output_router_logits_off_adds_nothing(padded_alpaca: dict[str, Any], tok: Any) -> None:
    """An MoE model whose config says output_router_logits: false (hub checkpoints ship it so) trains on the
    cross-entropy alone."""
    model = tiny_model("mixtral", output_router_logits=False)
    task = CausalLMTask(make_cfg(), None, 0, 0, 1, tokenizer=tok, row=SUPPORTED_MODELS["mixtral"])
    with torch.no_grad():
        loss = task.train_output(model, padded_alpaca) / task.count_targets(padded_alpaca)
        hf = model(input_ids=padded_alpaca["input_ids"], attention_mask=padded_alpaca["attention_mask"],
                   labels=padded_alpaca["labels"]).loss
    torch.testing.assert_close(loss, hf, rtol=1e-6, atol=1e-6)
    assert task.step_metrics(lambda sums: sums) == {}


class _Routed(torch.nn.Module):
    """A stand-in for an MoE model: a config with the router switch and coefficient."""

    def __init__(self, coefficient: object = 0.5) -> None:
        super().__init__()
        self.config = SimpleNamespace(output_router_logits=True, router_aux_loss_coef=coefficient)
        self.layer = torch.nn.Linear(2, 2)


def test_each_micro_batch_is_weighted_by_its_targets_over_ranks() -> None:
    """Two ranks' windows: the term of each micro-batch is coef x targets x aux, and the logged aux_loss is
    sum(targets x aux) / sum(targets) over both ranks (one reduce per step), then starts again."""
    model = torch.nn.Sequential(_Routed(0.5))  # found through a wrapper
    ranks = [router.RouterLoss(), router.RouterLoss()]
    windows = [[(1.0, 3), (2.0, 1)], [(4.0, 4), (7.0, 0)]]
    for loss, window in zip(ranks, windows, strict=True):
        for aux, targets in window:
            term = loss.term(model, torch.tensor(aux), torch.tensor(targets))
            assert term is not None and float(term) == 0.5 * targets * aux
    assert ranks[0].term(model, None, torch.tensor(5)) is None  # a forward without an aux loss adds nothing
    sums = [torch.stack([loss.weighted.double(), loss.targets.double()]) for loss in ranks]  # type: ignore[union-attr]
    calls = []

    def reduce(local: torch.Tensor) -> torch.Tensor:
        calls.append(local)
        return sums[0] + sums[1]

    assert ranks[0].step_metrics(reduce) == {"aux_loss": (1 * 3 + 2 * 1 + 4 * 4 + 7 * 0) / 8}
    assert len(calls) == 1
    assert ranks[0].step_metrics(reduce) == {} and len(calls) == 1  # nothing since the last step


def test_the_coefficient_is_read_through_peft(tok: Any) -> None:
    """The config of the model under a peft wrapper; a config without a number coefficient is one line."""
    import peft

    model = tiny_model("qwen3_moe")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert router.coefficient(wrapped) == model.config.router_aux_loss_coef
    with pytest.raises(ConfigError, match=r"^the model returns a router aux loss but its config has no number "
                                          r"router_aux_loss_coef \(None\); set model.config_overrides"):
        router.coefficient(_Routed(None))


def test_the_log_line_says_on_off_or_not_added(llama: Any) -> None:
    on, off = _Routed(0.02), _Routed(0.02)
    off.config.output_router_logits = False
    assert router.note(llama, True, "causal_lm") is None  # a dense model: no line
    assert router.note(on, True, "causal_lm") == (
        "router load-balancing loss: on, router_aux_loss_coef=0.02 x aux_loss added to the training loss (each "
        "micro-batch's weighted by its targets; logged as aux_loss)")
    assert router.note(off, True, "causal_lm") == (
        "router load-balancing loss: off (the model's config has output_router_logits: false); "
        "model.config_overrides.output_router_logits=true adds router_aux_loss_coef x aux_loss to the loss")
    assert router.note(on, False, "dpo") == (
        "router load-balancing loss: not added by task dpo (SFT only); the router trains on the task's loss alone")
