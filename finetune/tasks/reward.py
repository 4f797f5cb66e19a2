"""Reward modelling: a one-output sequence-classification head scores both sequences of each preference pair.

The loss is Bradley-Terry's: ``-log sigmoid(r_chosen - r_rejected)`` per pair, summed over the micro-batch's pairs
(the loop divides once by the pairs of the whole accumulation window on all ranks, so the loss is pair-weighted).
A batch (``PreferenceCollator``) holds the ``pairs`` chosen sequences in rows ``0..pairs-1`` and their rejected
partners in rows ``pairs..2*pairs-1``, right-padded into one tensor, so both are scored in ONE forward pass: the
same number of passes on every rank, and the same weights see both halves of a pair. The model is the causal LM
row's sequence-classification class (registry.for_task), which reads the score at each row's last token that is
not padding (modeling.set_reward_head); the export is that same class, so it reproduces these scores.

Metric ``preference_accuracy``: the pairs whose chosen sequence scores strictly higher than the rejected one (ties
lose). Means per pair (:attr:`EvalCounts.means`): ``reward_margin`` (chosen minus rejected score), ``reward_chosen``
and ``reward_rejected``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from finetune.tasks.base import EvalCounts, PairTask


def pair_rewards(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scores of the chosen and of the rejected sequences of a preference batch, each ``[pairs]``."""
    pairs = int(batch["pairs"])
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    scores = scores.float().squeeze(-1)  # [2 * pairs, 1] -> [2 * pairs]
    return scores[:pairs], scores[pairs:]


def bradley_terry_sum(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``sum over pairs of -log sigmoid(chosen - rejected)`` (``logsigmoid`` is stable for large margins)."""
    return -F.logsigmoid(chosen - rejected).sum()


class RewardTask(PairTask):
    """Preference pairs (``data.format: preference``); a "target" is a pair."""

    eval_means = ("reward_margin", "reward_chosen", "reward_rejected")

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        return bradley_terry_sum(*pair_rewards(model, batch))

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts:
        chosen, rejected = pair_rewards(model, batch)
        pairs = torch.tensor(chosen.numel(), device=chosen.device)
        counts = EvalCounts(bradley_terry_sum(chosen, rejected), pairs)
        if "preference_accuracy" in self.cfg.eval.metrics:
            counts.correct["preference_accuracy"] = (chosen > rejected).sum()
            counts.total["preference_accuracy"] = pairs
        counts.means["reward_margin"] = ((chosen - rejected).sum(), pairs)
        counts.means["reward_chosen"] = (chosen.sum(), pairs)
        counts.means["reward_rejected"] = (rejected.sum(), pairs)
        return counts
