"""Example plugin: a small custom causal LM (plain torch, no transformers) registered as model type ``tiny-custom``.

A recipe uses it with ``model: {type: tiny-custom, plugin: tests.plugins.tiny_custom_lm}``. The row names the
factory :func:`build` instead of Hugging Face classes, the block class FSDP wraps (``TinyBlock``), the batch keys its
forward takes (no ``position_ids``: the model counts positions itself) and the bundled tokenizer of tiny-llama.
It claims no capabilities (no packing, generation, gradient checkpointing or preference tuning) and no LoRA
targets. The forward returns the bare logits tensor; finetune wraps it into an output with ``.logits``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from finetune.registry import SupportedModel, register

# 22,816 parameters, most of them the embedding and the head (vocab 512 of the tiny-llama tokenizer x hidden 16)
DEFAULT_CONFIG: dict[str, Any] = {"vocab_size": 512, "hidden_size": 16, "num_heads": 2, "mlp_size": 32,
                                  "num_blocks": 2, "max_positions": 128, "dropout": 0.0}


class TinyAttention(nn.Module):
    """Multi-head self-attention under a boolean mask (True: may attend)."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        # no bias: a key bias shifts every score of a row equally, so its true gradient is 0 and Adam would turn
        # rounding noise into full-size steps (weights that then differ between layouts by far more than 1e-4)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        head_dim = hidden // self.num_heads
        q, k, v = self.qkv(x).view(batch, length, 3, self.num_heads, head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)  # finite: a fully masked row stays finite
        weights = self.dropout(scores.softmax(-1))
        return self.out((weights @ v).transpose(1, 2).reshape(batch, length, hidden))


class TinyBlock(nn.Module):
    """Pre-norm block: attention then MLP, each with a residual (the class FSDP wraps)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_size: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size)
        self.attn = TinyAttention(hidden_size, num_heads, dropout)
        self.norm2 = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, mlp_size), nn.GELU(), nn.Linear(mlp_size, hidden_size),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), allowed)
        return x + self.mlp(self.norm2(x))


class TinyCustomLM(nn.Module):
    """Token + learned position embeddings, ``num_blocks`` TinyBlocks, a final norm and an untied head."""

    def __init__(self, vocab_size: int, hidden_size: int, num_heads: int, mlp_size: int, num_blocks: int,
                 max_positions: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(max_positions, hidden_size)  # finetune checks max_seq_len against it
        self.blocks = nn.ModuleList(TinyBlock(hidden_size, num_heads, mlp_size, dropout) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, length, vocab]``: causal attention, padded keys (mask 0) hidden."""
        length = input_ids.size(1)
        positions = torch.arange(length, device=input_ids.device)
        x = self.embed(input_ids) + self.position_embeddings(positions)[None]
        allowed = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, allowed)
        return self.head(self.norm(x))


def build(config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The factory the row names: the model from ``config`` (the row's tiny config + model.config_overrides), its
    weights drawn from torch's global generator (finetune seeds it with train.seed first)."""
    return TinyCustomLM(**config).to(dtype)


class _WithOutput(nn.Module):
    """The same model, with a forward that returns an object holding ``.logits`` (the other allowed output)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.inner(input_ids, attention_mask))


def build_with_output(config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """A factory whose model returns an object with ``.logits`` instead of the tensor (tests of that path)."""
    return _WithOutput(build(config, dtype))


register(SupportedModel(
    name="tiny-custom", task="causal_lm", factory="tests.plugins.tiny_custom_lm:build", decoder_layer="TinyBlock",
    tiny_config=DEFAULT_CONFIG, tokenizer="tiny-llama-tokenizer", debug_build=True,
    model_inputs=("input_ids", "attention_mask"),
    description="test plugin: a small custom causal LM in plain torch (not transformers)",
))
