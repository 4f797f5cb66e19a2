"""``train.dropout: false``: every dropout of the model trained is off, whatever its config says.

DPO, reward models and GRPO compare the policy with a reference (or two samples with each other) that is scored
without dropout; with dropout on, the policy and the reference differ before the first update (DPO's first loss is
not ln 2) and the comparison is noise. The DPO paper's code and TRL train them with dropout off, and so does
finetune by default for those tasks (the schema resolves ``train.dropout: null`` by task).

Dropout lives in two places in Hugging Face models, and both are set to 0 in the built (and LoRA-wrapped) model:

- dropout modules (``nn.Dropout`` and its kin: hidden, embedding, classifier dropout, and peft's ``lora_dropout``):
  their ``p``;
- rates that attention modules keep as plain numbers and pass to the attention kernel while training (Llama's,
  Qwen's, Mistral's ``attention_dropout``, layer drop): every float attribute of a module whose name says dropout
  (``dropout``, ``*_dropout``, ``*_pdrop``, ``layerdrop``, ``drop_prob``).

The model's config is not changed, so an export keeps the dropout its config had (a later fine-tune can use it).
tests/unit/test_dropout.py runs every SupportedModel row with every dropout rate of its config at 0.1: two
training-mode forward passes agree with each other and with eval mode once this has run.
"""

from __future__ import annotations

import re
from typing import Any

import torch

RATE_NAME = re.compile(r"(^|_)(dropout|pdrop|layerdrop)(_|$)|^drop_prob$")


def is_rate(name: str, value: Any) -> bool:
    """Whether a module attribute ``name`` = ``value`` is a dropout rate (a float whose name says dropout)."""
    return type(value) is float and bool(RATE_NAME.search(name))


def disable(model: torch.nn.Module) -> tuple[int, int]:
    """Set every dropout of ``model`` to 0 (see the module docstring); returns (dropout modules, rates) that were
    not 0 already, for the run's log line."""
    modules = rates = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            modules += module.p != 0
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if is_rate(name, value):
                rates += value != 0
                setattr(module, name, 0.0)
    return modules, rates


__all__ = ["disable", "is_rate"]
