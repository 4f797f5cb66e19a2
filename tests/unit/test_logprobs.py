"""finetune.tasks.logprobs: which tokens are next-token targets (never position 0, never an ignored label), the
shifted loss over logits a caller holds, and which module is the output head."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.data.tokenize import IGNORE


def test_next_token_targets_ignore_position_zero() -> None:
    from finetune.tasks.logprobs import count_next_token_targets

    labels = torch.tensor([[7, 5, 6, IGNORE], [IGNORE, IGNORE, 8, 9]])
    assert count_next_token_targets(labels) == 4  # the 7 at position 0 is never a target


def test_the_shifted_loss_sums_over_the_next_labels_and_counts_them() -> None:
    """Position t is scored against label t+1; the last position and ignored labels add nothing. Uniform logits
    over 4 classes cost ln 4 per target."""
    from finetune.tasks.logprobs import shifted_loss

    labels = torch.tensor([[1, 2, IGNORE, 3]])
    loss_sum, count, targets = shifted_loss(torch.zeros(1, 4, 4), labels)
    assert targets.tolist() == [[2, IGNORE, 3, IGNORE]]
    assert int(count) == 2
    assert float(loss_sum) == pytest.approx(2 * math.log(4))


def test_find_head_takes_the_shallowest_module_of_that_name() -> None:
    from finetune.tasks.logprobs import find_head

    outer = torch.nn.Linear(2, 2)
    model = torch.nn.ModuleDict({"body": torch.nn.ModuleDict({"lm_head": torch.nn.Linear(2, 2)}), "lm_head": outer})
    assert find_head(model, "lm_head") is outer
    assert find_head(model, "missing") is None and find_head(model, None) is None
