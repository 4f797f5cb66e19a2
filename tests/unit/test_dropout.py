"""train.dropout (finetune.runtime.dropout): false switches every dropout of every SupportedModel row off, LoRA's
included, without touching the config an export saves; null resolves by task (off for dpo, reward and grpo, as the
DPO paper's code and TRL train them); the plan shows it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers

from finetune.config.schema import RecipeConfig
from finetune.registry import SUPPORTED_MODELS
from finetune.runtime import dropout
from finetune.runtime import peft as lora

ROWS = sorted(name for name, row in SUPPORTED_MODELS.items() if row.factory is None)


def _rates_to(config: Any, rate: float) -> list[str]:
    """Set every dropout rate a config (and its sub-configs) has to ``rate``; the keys set."""
    found = []
    for key, value in list(vars(config).items()):
        if isinstance(value, transformers.PretrainedConfig):
            found += [f"{key}.{k}" for k in _rates_to(value, rate)]
        elif (value is None or type(value) in (int, float)) and dropout.is_rate(key, 0.0):  # a rate's name
            setattr(config, key, rate)
            found.append(key)
    return found


@pytest.mark.parametrize("name", ROWS)
def test_every_dropout_of_every_row_is_off(name: str) -> None:
    row = SUPPORTED_MODELS[name]
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    if row.task == "classification":
        config.num_labels = 3
    assert _rates_to(config, 0.3), "the row's config has dropout rates to switch off"
    saved = config.to_dict()
    torch.manual_seed(0)
    model = getattr(transformers, row.auto_class).from_config(config).train()
    ids = torch.randint(0, 500, (2, 12))

    def logits() -> torch.Tensor:
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

    assert not torch.equal(logits(), logits()), "dropout is on before (else this test proves nothing)"
    modules, rates = dropout.disable(model)
    assert modules + rates > 0
    first, second = logits(), logits()
    assert torch.equal(first, second)
    model.eval()
    assert torch.allclose(first, logits(), atol=1e-6)
    assert model.config.to_dict() == saved  # an export keeps the config's rates


def test_lora_dropout_is_off_too() -> None:
    from finetune.config.schema import PeftConfig

    row = SUPPORTED_MODELS["tiny-llama"]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**row.tiny_config))
    model = lora.apply(model, PeftConfig(method="lora", dropout=0.5), row)
    adapters = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n]
    assert adapters and all(m.p == 0.5 for m in adapters)
    modules, _ = dropout.disable(model)
    assert modules == len(adapters) and all(m.p == 0 for m in adapters)


def _recipe(task: str | None, **train: Any) -> RecipeConfig:
    data = {"format": "prompt" if task == "grpo" else "preference" if task in ("dpo", "reward") else "alpaca",
            "train": "t.jsonl"}
    extra = {"grpo": {"rewards": [{"exact_match": True}]}} if task == "grpo" else {}
    return RecipeConfig.model_validate({"name": "r", "task": task, "model": {"type": "tiny-llama"}, "data": data,
                                        "train": {"max_steps": 1, **train}, **extra})


@pytest.mark.parametrize(("task", "on"), [(None, True), ("sft", True), ("dpo", False), ("reward", False),
                                          ("grpo", False)])
def test_null_is_the_tasks_and_a_value_is_kept(task: str | None, on: bool) -> None:
    assert _recipe(task).train.dropout is on
    assert _recipe(task, dropout=not on).train.dropout is (not on)


def test_the_plan_says_whether_dropout_is_on() -> None:
    from finetune.commands.plan import render
    from finetune.runtime.plan import build_plan

    assert "  dropout: off, every rate at 0 while training" in render(build_plan(_recipe("dpo"), devices=[]))
    sft = render(build_plan(_recipe("sft"), devices=[]))
    assert "  dropout: on, as the model's config and peft.dropout set it" in sft
