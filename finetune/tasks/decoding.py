"""The decoder: greedy or sampled generation with a KV cache from left-padded prompts, shared by eval's
``exact_match``, GRPO's rollouts and ``finetune generate``.

Generation runs a fixed number of forward passes on every rank unless asked to stop early (``stop_when_done``), so
sharded backends stay in lockstep; sampling draws one number per new token from each row's own generator, so what
a prompt samples never depends on the other rows of its batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from finetune.tasks.router import routed_config


def stop_at(tokens: Sequence[int], stop_ids: Sequence[int]) -> int | None:
    """The index of the first stop token among ``tokens`` (None: none): where a generated answer ends."""
    return next((i for i, token in enumerate(tokens) if token in stop_ids), None)


def answers(new_tokens: torch.Tensor, stop_ids: Sequence[int], tokenizer: Any) -> list[str]:
    """Each row of generated tokens up to (not including) its first stop token, decoded without special tokens:
    the answer eval's metrics compare, and what GRPO's rewards read."""
    out = []
    for row in new_tokens.tolist():
        stop = stop_at(row, stop_ids)
        out.append(tokenizer.decode(row if stop is None else row[:stop], skip_special_tokens=True))
    return out


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding: ``temperature`` > 0, nucleus ``top_p`` in (0, 1], and one CPU generator per prompt row.

    Each row draws exactly one uniform number per new token from its own generator, so what a prompt samples
    depends on its generator's seed alone, never on the other rows of its batch (or the batch size)."""

    temperature: float
    top_p: float
    generators: Sequence[torch.Generator]


def sample_next(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One token per row from ``softmax(logits / temperature)`` cut to its top-p nucleus, by inverse CDF: the
    sorted probabilities' cumulative sum is searched for the row's uniform draw (a stable sort keeps ties in
    vocabulary order, so the choice is a function of the logits and the draw)."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    if sampling.top_p < 1.0:  # keep the most likely tokens until their mass reaches top_p (always the first)
        sorted_probs = sorted_probs * ((sorted_probs.cumsum(-1) - sorted_probs) < sampling.top_p)
    cdf = sorted_probs.cumsum(-1)
    draws = torch.stack([torch.rand((), generator=g) for g in sampling.generators]).to(cdf.device)
    pick = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
    last = (sorted_probs > 0).sum(-1, keepdim=True) - 1  # a draw rounded up to the total takes the last kept token
    return order.gather(-1, torch.minimum(pick, last)).squeeze(-1)


@torch.no_grad()
def generate_tokens(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int,
                    stop_ids: Sequence[int], pad_id: int, sampling: Sampling | None = None,
                    stop_when_done: bool = False) -> torch.Tensor:
    """Decode with a KV cache from left-padded prompts (greedy, or ``sampling``); returns the new tokens, with pad
    after a row's first stop token. Position ids count each row's real tokens only and the mask hides its padding,
    so a row's tokens do not depend on the other rows. ``stop_when_done``: end once every row has stopped (fewer
    columns); off, every call runs ``max_new_tokens`` forward passes (lockstep for sharded backends)."""
    mask = prompt_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # a mixture-of-experts model computes no router aux loss while it decodes: transformers' would meet the whole
    # attention mask with the router logits of the new token only (and generation trains nothing)
    router = {"output_router_logits": False} if routed_config(model) is not None else {}
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True, **router)
    done = torch.zeros(prompt_ids.size(0), dtype=torch.bool, device=prompt_ids.device)
    stops = torch.tensor(list(stop_ids), dtype=prompt_ids.dtype, device=prompt_ids.device)
    new_tokens = []
    for i in range(max_new_tokens):
        logits = out.logits[:, -1]
        token = logits.argmax(-1) if sampling is None else sample_next(logits, sampling)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        new_tokens.append(token)
        if len(stops):
            done |= torch.isin(token, stops)
        if i + 1 == max_new_tokens or (stop_when_done and bool(done.all())):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                    **router, **_kv_cache(out))
    return torch.stack(new_tokens, dim=1)


def _kv_cache(out: Any) -> dict[str, Any]:
    """The KV cache of a forward's output, as the keyword argument the model takes it back by: ``cache`` since
    transformers 5.24 (which deprecates ``past_key_values`` both ways, with a warning), else ``past_key_values``."""
    # transformers' ModelOutput is a mapping; any other output object (a custom row's, a test double) has attributes
    cache = out.get("cache") if isinstance(out, Mapping) else getattr(out, "cache", None)
    return {"cache": cache} if cache is not None else {"past_key_values": out.past_key_values}
