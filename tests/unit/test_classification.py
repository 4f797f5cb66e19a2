"""finetune.tasks.classification on a tiny BERT built from its config: the summed loss and the counts the loop
divides equal torch's cross entropy and accuracy (forward passes only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from finetune.data.batching import Collator
from finetune.tasks.classification import ClassificationTask
from tests.task_config import make_cfg


def test_classification_train_output_matches_cross_entropy() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=512, num_labels=3)
    model = transformers.BertForSequenceClassification(config).eval()
    batch = Collator(pad_id=0)([{"input_ids": [1, 40, 41, 42, 2], "label": 2}, {"input_ids": [1, 50, 2], "label": 0},
                                {"input_ids": [1, 60, 61, 2], "label": 1}])
    task = ClassificationTask(make_cfg(["accuracy"]), None, 0, 0, 1)
    with torch.no_grad():
        loss_sum, n = task.train_output(model, batch), task.count_targets(batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        counts = task.eval_output(model, batch)
    torch.testing.assert_close(loss_sum, F.cross_entropy(logits, batch["label"], reduction="sum"))
    assert n == 3
    torch.testing.assert_close(counts.loss_sum, loss_sum)
    assert int(counts.num_tokens) == 3
    assert int(counts.correct["accuracy"]) == int((logits.argmax(-1) == batch["label"]).sum())
    assert int(counts.total["accuracy"]) == 3
