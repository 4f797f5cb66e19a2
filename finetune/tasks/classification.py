"""Sequence classification: one target per sample; metric ``accuracy``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from finetune.tasks.base import EvalCounts, TaskData


class ClassificationTask(TaskData):
    """Rows ``{text, label}``; the loss is summed over samples, so "tokens" here are samples."""

    def _logits(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()

    def count_targets(self, batch: dict[str, Any]) -> int:
        """One target per sample."""
        return int(batch["label"].numel())

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(self._logits(model, batch), batch["label"], reduction="sum")

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts:
        logits = self._logits(model, batch)
        labels = batch["label"]
        n = torch.tensor(labels.numel(), device=logits.device)
        counts = EvalCounts(F.cross_entropy(logits, labels, reduction="sum"), n)
        if "accuracy" in self.cfg.eval.metrics:
            counts.correct["accuracy"] = (logits.argmax(-1) == labels).sum()
            counts.total["accuracy"] = n
        return counts
