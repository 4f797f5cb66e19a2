"""Test plugin: flash-attn's dtype rule on the CPU, as the attention kernel ``half_only_attention``.

flash-attn has no CPU kernels, and it refuses float32 inputs ("FlashAttention only support fp16 and bf16 data
type"). transformers' own flash path (``integrations/flash_attention.py``) first casts float32 queries, keys and
values to the autocast dtype when autocast is on, else to the dtype of the model's Linear weights, so a model with
float32 weights runs flash-attn only inside bf16/fp16 autocast. This kernel does exactly that cast and then refuses
float32 as flash-attn does; otherwise it computes sdpa's attention. A forward that runs outside the training
precision (fp32 weights, no autocast) therefore crashes here as it would on a GPU with flash_attention_2.

A recipe uses it with ``model: {plugin: tests.plugins.half_only_attention, config_overrides: {_attn_implementation:
half_only_attention}}`` (the schema's ``model.attn_implementation`` lists transformers' own kernels only; the
config key is what that setting becomes). The name holds no "flash": transformers treats such names as flash-attn
builds to fetch from the hub. Importing the module registers the kernel and its mask builder (sdpa's)
with transformers; :data:`CALLS` counts the calls that ran, by input dtype, so a test can tell the kernel was used.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.flash_attention import get_target_dtype
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "half_only_attention"
MESSAGE = "FlashAttention only support fp16 and bf16 data type"  # flash-attn's own words
CALLS: Counter[str] = Counter()  # str(dtype) of the inputs the kernel computed with -> calls


def half_only_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """sdpa's attention after transformers' flash-attn cast; RuntimeError for float32 inputs, as flash-attn."""
    target = get_target_dtype(query, module)
    if target is not None:
        query, key, value = query.to(target), key.to(target), value.to(target)
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(MESSAGE)
    CALLS[str(query.dtype)] += 1
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, half_only_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
