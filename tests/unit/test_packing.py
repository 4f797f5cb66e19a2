"""Padding-free packing is exact: a sample's logits and loss are the same alone and packed among others.

transformers derives sample boundaries from restarting ``position_ids`` only when no attention mask and no KV
cache are given; these tests prove it (rather than assume it) for every SupportedModel row that claims the
``packing`` capability, with each attention implementation that runs on CPU, and show that the check can fail
(positions that do not restart let samples attend to each other).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from finetune.config import RecipeConfig
from finetune.data.batching import Collator, PackingCollator
from finetune.data.tokenize import IGNORE
from finetune.registry import SUPPORTED_MODELS, SupportedModel
from finetune.tasks.causal_lm import CausalLMTask
from tests.integration.conftest import tiny_recipe

PACKING_ROWS = [row for row in SUPPORTED_MODELS.values() if "packing" in row.capabilities]
LENGTHS = (7, 1, 12, 3, 9)


def _model(row: SupportedModel, attn: str) -> Any:
    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**row.tiny_config)
    model = getattr(transformers, row.auto_class).from_config(config, attn_implementation=attn)
    return model.eval()


def _rows(vocab: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        labels = [IGNORE if i < n // 3 else tid for i, tid in enumerate(ids)]  # a masked prompt, like real data
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _task() -> CausalLMTask:
    cfg = RecipeConfig.model_validate(tiny_recipe(data={"eval": None, "packing": True}))
    return CausalLMTask(cfg, None, 0, 0, 1, tokenizer=None)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("row", PACKING_ROWS, ids=lambda r: r.name)
def test_a_sample_is_the_same_alone_and_packed(row: SupportedModel, attn: str) -> None:
    """Logits of each sample inside the packed row equal its logits alone (<= 1e-5), and so does its loss."""
    model, rows = _model(row, attn), _rows(row.tiny_config.get("vocab_size", 512))
    task, packed = _task(), PackingCollator()(rows)
    assert packed["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in packed
    with torch.no_grad():
        packed_logits = task._logits(model, packed)[0]
        alone = [task._logits(model, Collator(0)([r]))[0] for r in rows]
        packed_loss = task.train_output(model, packed)
        losses = [task.train_output(model, Collator(0)([r])) for r in rows]
    start = 0
    for sample, logits in zip(rows, alone, strict=True):
        end = start + len(sample["input_ids"])
        torch.testing.assert_close(packed_logits[start:end], logits, rtol=1e-5, atol=1e-5)
        start = end
    torch.testing.assert_close(packed_loss, sum(losses), rtol=1e-5, atol=1e-5)
    assert task.count_targets(packed) == sum(task.count_targets(Collator(0)([r])) for r in rows)


@pytest.mark.parametrize("row", PACKING_ROWS[:1], ids=lambda r: r.name)
def test_the_check_fails_when_samples_attend_to_each_other(row: SupportedModel) -> None:
    """Control: positions that run on across samples (no restart) give other logits, so the test above can fail."""
    model, rows = _model(row, "sdpa"), _rows(512)
    packed = PackingCollator()(rows)
    running = {**packed, "position_ids": torch.arange(packed["input_ids"].size(1))[None]}
    with torch.no_grad():
        good = _task()._logits(model, packed)[0]
        bad = _task()._logits(model, running)[0]
    first = len(rows[0]["input_ids"])
    torch.testing.assert_close(good[:first], bad[:first])  # the first sample sees nothing else either way
    assert (good[first:] - bad[first:]).abs().max() > 1e-2


def test_the_packed_row_holds_the_padded_batch_targets() -> None:
    rows = [{"input_ids": [1, 10, 11, 2], "labels": [IGNORE, IGNORE, 11, 2]},
            {"input_ids": [1, 20, 2], "labels": [1, 20, 2]}]
    packed = PackingCollator()(rows)
    assert packed["input_ids"].tolist() == [[1, 10, 11, 2, 1, 20, 2]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    # the second sample's first token is not the first sample's next token; its own first label is never a target
    assert packed["labels"].tolist() == [[IGNORE, IGNORE, 11, 2, IGNORE, 20, 2]]
    task = _task()
    assert task.count_targets(packed) == task.count_targets(Collator(0)(rows)) == 4


def test_packing_keeps_the_sample_stream() -> None:
    """The train loader packs exactly the samples the padded loader batches (the cursor counts samples)."""
    import datasets

    from finetune.data import DataBundle
    from finetune.data.tokenize import Tokenized

    rows = _rows(512) * 4
    bundle = DataBundle(Tokenized(datasets.Dataset.from_list(rows), 0, 0, 0), None, None)
    batches = {}
    for packing in (False, True):
        cfg = RecipeConfig.model_validate(tiny_recipe(data={"eval": None, "packing": packing},
                                                      train={"micro_batch_size": 2, "global_batch_size": 4}))
        loader = iter(CausalLMTask(cfg, bundle, 0, 0, 1, tokenizer=None).build_dataloader("train", start_sample=3))
        batches[packing] = [next(loader) for _ in range(5)]
    for padded, packed in zip(batches[False], batches[True], strict=True):
        real = padded["attention_mask"].bool()
        assert packed["input_ids"][0].tolist() == padded["input_ids"][real].tolist()
        assert packed["position_ids"].size(1) == int(real.sum())
