"""finetune.tasks.decoding: greedy generation from left-padded prompts equals ``model.generate`` on each prompt
alone, with rotary and absolute positions, and pads after eos (tiny models built from configs); every family that
generates does so through its own cache as it computes without one."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers

from finetune import registry
from finetune.data.batching import left_pad
from finetune.tasks.decoding import generate_tokens


def hf_greedy(model: Any, prompt: list[int], n: int, eos_id: int | None = None) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, eos_token_id=eos_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_generate_matches_hf_generate_on_unpadded_prompts(llama: Any) -> None:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (3, 7, 1, 5)]
    ids, mask = left_pad(prompts, pad_id=0)
    new = generate_tokens(llama, ids, mask, 10, [], 0)
    assert new.shape == (4, 10)
    for prompt, row in zip(prompts, new.tolist(), strict=True):
        assert row == hf_greedy(llama, prompt, 10)


def test_greedy_generate_positions_with_absolute_embeddings() -> None:
    """RoPE is blind to a constant position offset; GPT-2's absolute positions catch wrong left-pad positions."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64,
                                     initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (2, 6, 4)]
    ids, mask = left_pad(prompts, pad_id=0)
    new = generate_tokens(model, ids, mask, 6, [], 0)
    for prompt, row in zip(prompts, new.tolist(), strict=True):
        assert row == hf_greedy(model, prompt, 6)


def test_greedy_generate_pads_after_eos(llama: Any) -> None:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (4, 2, 6)]
    ids, mask = left_pad(prompts, pad_id=0)
    free = generate_tokens(llama, ids, mask, 8, [], 0).tolist()
    eos = free[0][2]  # pretend the third token row 0 generates is eos
    new = generate_tokens(llama, ids, mask, 8, [eos], 0).tolist()
    for prompt, free_row, row in zip(prompts, free, new, strict=True):
        if eos in free_row:
            cut = free_row.index(eos) + 1
            assert row[:cut] == free_row[:cut] and row[cut:] == [0] * (8 - cut)
        else:
            assert row == free_row
        # HF stops at eos too: identical up to and including the first eos
        reference = hf_greedy(llama, prompt, 8, eos_id=eos)
        assert row[:len(reference)] == reference
    assert new[0][3:] == [0] * 5


def test_a_mixture_of_experts_model_with_its_router_loss_on_decodes_as_generate() -> None:
    """An MoE model whose config turns the router aux loss on (Mixtral, GPT-OSS with its sliding window and sinks):
    decoding with the KV cache computes no aux loss (transformers' would meet the whole mask with the new token's
    router logits and fail) and gives transformers' own greedy tokens for left-padded prompts."""
    from tests.moe_rows import tiny_model

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (4, 9, 2)]
    ids, mask = left_pad(prompts, pad_id=0)
    for name in ("mixtral", "gpt_oss"):
        model = tiny_model(name).eval()
        assert model.config.output_router_logits
        new = generate_tokens(model, ids, mask, 6, [], 0)
        model.config.output_router_logits = False  # transformers' generate with the loss off, as a reference
        for prompt, row in zip(prompts, new.tolist(), strict=True):
            assert row == hf_greedy(model, prompt, 6), name


GENERATING_ROWS = sorted(name for name, row in registry.SUPPORTED_MODELS.items()
                         if "generation" in row.capabilities and row.task == "causal_lm" and row.factory is None)


@pytest.mark.parametrize("name", GENERATING_ROWS)
def test_every_family_generates_from_left_padded_prompts_as_without_a_cache(name: str) -> None:
    """Each family's tiny model, prompts of different lengths left-padded into one batch: the KV-cached greedy tokens
    are those of each prompt alone recomputed from scratch at every step (no cache, no padding), through sliding
    windows shorter than prompt and answer, soft-caps, NoPE layers and the rest of what each family does."""
    row = registry.SUPPORTED_MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    model = getattr(transformers, row.auto_class).from_config(config).eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (6, 2, 9)]
    ids, mask = left_pad(prompts, pad_id=0)
    new = generate_tokens(model, ids, mask, 7, [], 0)
    for prompt, row_tokens in zip(prompts, new.tolist(), strict=True):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(7):
                tokens.append(int(model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
        assert row_tokens == tokens[len(prompt):]
