"""finetune.runtime.collapse: which steps look collapsed (a zero gradient at the loss of an output that ignores its
input), per task, and which do not: a healthy run, a model that predicts perfectly, GRPO's zero-advantage steps,
steps skipped for an fp16 overflow, a freshly initialised model. The stop itself, on a real run, is
tests/integration/test_collapse.py."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from finetune.runtime import collapse

VOCAB = 512
LN_VOCAB = math.log(VOCAB)


class _LM(torch.nn.Module):
    """A causal LM as the loop sees it: an output head of ``VOCAB`` logits per token."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, VOCAB, bias=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def _watch(objective: str | None = None, row_task: str | None = "causal_lm", model: object = None) -> collapse.Watch:
    return collapse.Watch(collapse.signature(objective, row_task, _LM() if model is None else model))


def _stops(watch: collapse.Watch, rows: list[tuple[float, float, bool]]) -> bool:
    """Whether ``watch`` stops the run at some step of ``rows`` (loss, grad_norm, skipped), none of them its end."""
    return any(watch.observe(loss, grad, skipped) and watch.must_stop(ending=False) for loss, grad, skipped in rows)


DEAD = (LN_VOCAB + 1e-9, 0.0, False)  # a collapsed causal-LM step: every logit equal, no gradient


def test_zero_gradient_at_the_uniform_loss_for_a_few_steps_in_a_row_stops_the_run() -> None:
    watch = _watch()
    healthy = [(6.2366, 2.1, False), (5.9, 1.4, False)]
    assert not _stops(watch, healthy + [DEAD] * (collapse.STEPS - 1))
    assert watch.streak == collapse.STEPS - 1
    assert watch.observe(*DEAD) and watch.must_stop(ending=False)


def test_a_run_that_ends_at_a_collapsed_step_stops_there() -> None:
    """The last step's weights would be the export, a stop signal's checkpoint would be resumed: one collapsed step
    is enough there, and a step that does not look collapsed ends the run as usual."""
    watch = _watch()
    assert watch.observe(*DEAD) and not watch.must_stop(ending=False) and watch.must_stop(ending=True)
    assert not _watch().must_stop(ending=True)


@pytest.mark.parametrize("rows", [
    [(6.2366, 2.1, False), (4.1, 1.3, False), (1.2, 0.8, False), (0.3, 0.2, False), (0.02, 0.05, False)],
    [(1e-9, 0.0, False)] * 5,  # predicts every target: ~0 loss and ~0 gradient
    [(0.0, 0.0, False)] * 5,  # a window whose every target was ignored
    [(LN_VOCAB - 0.0017, 0.0, False)] * 5,  # a fresh tiny model's first loss (near ln V) with nothing to train
    [(LN_VOCAB, 1e-3, False)] * 5,  # the uniform loss, but a live gradient (e.g. a zero-initialised head)
], ids=["healthy", "perfect", "no-targets", "fresh-frozen", "uniform-but-live"])
def test_no_other_run_stops(rows: list[tuple[float, float, bool]]) -> None:
    assert not _stops(_watch(), rows)


def test_a_skipped_step_is_not_collapsed_and_breaks_the_streak() -> None:
    """An fp16 overflow (infinite gradient norm; DeepSpeed reports inf too) makes no update: not counted, and the
    streak starts over."""
    overflow, zero_but_skipped = (LN_VOCAB, math.inf, True), (LN_VOCAB, 0.0, True)
    watch = _watch()
    assert not _stops(watch, [DEAD, DEAD, overflow, DEAD, DEAD, zero_but_skipped, DEAD, DEAD])
    assert not watch.observe(*overflow) and watch.streak == 0
    assert not watch.observe(math.nan, math.nan, True)


def test_grpo_is_never_checked() -> None:
    """A group whose completions all got the same reward has advantage 0: the gradient is legitimately zero, at a
    loss of 0 (no KL term), of the KL term alone, or of clipped ratios."""
    watch = _watch("grpo")
    assert watch.signature is None
    assert not _stops(watch, [(0.0, 0.0, False), (LN_VOCAB, 0.0, False), (0.3, 0.0, False)] * 3)


def test_dpo_stops_on_a_zero_gradient_at_any_loss_but_a_perfect_one() -> None:
    """A dead policy's DPO loss depends on the reference log-probs (near ln 2 when the reference is near uniform
    too): any loss from LOSS_FLOOR up, with a zero gradient, is a collapse; a perfectly separated batch is not."""
    watch = _watch("dpo")
    assert watch.signature is not None and watch.signature.outcomes is None
    assert not _stops(watch, [(math.log(2), 0.52, False)] * 3)  # step 1: policy == reference, a live gradient
    assert not _stops(watch, [(1e-9, 0.0, False)] * 3)
    assert _stops(watch, [(0.6928, 0.0, False), (0.6969, 0.0, False), (0.6951, 0.0, False)])


@pytest.mark.parametrize(("objective", "row_task", "model", "outcomes"), [
    (None, "causal_lm", _LM(), VOCAB),
    ("sft", "vision_causal_lm", SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: LlamaConfig(
        vocab_size=576))), 576),  # no output head to read: the text config's vocabulary
    (None, "classification", SimpleNamespace(config=SimpleNamespace(num_labels=3)), 3),
    ("reward", "reward", SimpleNamespace(config=SimpleNamespace(num_labels=1)), 2),
    (None, "causal_lm", object(), None),  # a custom model that names neither: the zero gradient and the floor
])
def test_the_uniform_loss_of_each_task(objective: str | None, row_task: str, model: object,
                                       outcomes: int | None) -> None:
    found = collapse.signature(objective, row_task, model)
    assert found is not None and found.outcomes == outcomes
    if outcomes is not None:
        assert found.matches(math.log(outcomes), 0.0) and not found.matches(math.log(outcomes), 0.1)


def test_the_stop_line_says_what_collapsed_the_cause_and_what_is_kept() -> None:
    watch = _watch()
    for _ in range(collapse.STEPS):
        watch.observe(*DEAD)
    line = watch.stop_line(16, DEAD[0], 1000.0, Path("runs/x"), "step-000010")
    assert "\n" not in line
    assert line.startswith(f"training collapsed: for {collapse.STEPS} steps in a row up to step 16 the gradient norm "
                           f"was 0 and the loss sat at ln({VOCAB}) = {LN_VOCAB:.4f}")
    assert "nothing was exported" in line and "optim.lr 1000" in line
    assert "`finetune resume runs/x --from step-000010 optim.lr=... --allow-config-change`" in line
    assert "no checkpoint was saved" in watch.stop_line(16, DEAD[0], 1000.0, Path("runs/x"), None)
