"""Causal language modelling: next-token loss on answer tokens; metrics ``token_accuracy`` and ``exact_match``.

``token_accuracy`` is teacher-forced (argmax of each answer position given the true prefix). ``exact_match`` is a
different metric: greedy generation from the prompt alone, compared with the reference answer after whitespace
normalisation. Generation runs a fixed number of forward passes on every rank (no early exit), so sharded
backends stay in lockstep. ``finetune generate`` decodes with the same function (:func:`generate_tokens`), greedy or
sampled, ending early once every prompt of a batch has stopped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from finetune import registry
from finetune.data.rows import IGNORE
from finetune.errors import ConfigError
from finetune.tasks.base import EvalCounts, TaskData
from finetune.tasks.losses import sequence_logprobs, summed_cross_entropy


def normalize(text: str) -> str:
    """Whitespace-normalised answer text for exact_match."""
    return " ".join(text.split())


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """The target of every position: the next label, IGNORE at the end. The labels are shifted rather than the
    logits, so the ``[tokens x vocab]`` logits are never sliced into a copy."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def count_next_token_targets(labels: torch.Tensor) -> int:
    """Target tokens of a batch: labels after the first position that are not IGNORE."""
    return int((labels[:, 1:] != IGNORE).sum())


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over logits a caller already holds (fp32 arithmetic, one chunk at a time:
    see :mod:`finetune.tasks.losses`), the number of target tokens, and the targets (IGNORE where none). The tasks
    never build those logits (:func:`answer_logprobs`)."""
    targets = next_token_targets(labels)
    loss_sum = summed_cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return loss_sum, (targets != IGNORE).sum(), targets


def find_head(model: Any, name: str | None) -> Any:
    """The module named ``name`` (the row's ``output_head``) in ``model`` through any wrapper (DDP, FSDP, DeepSpeed,
    peft): the shallowest module whose last name part is ``name``; None when there is none (or no name)."""
    if not name or not hasattr(model, "named_modules"):  # not an nn.Module (a scripted test double): its logits
        return None
    found = [(path.count("."), module) for path, module in model.named_modules() if path.rsplit(".", 1)[-1] == name]
    return min(found, key=lambda item: item[0])[1] if found else None


def head_logprobs(model: Any, inputs: dict[str, Any], targets: torch.Tensor, seq: torch.Tensor, sequences: int,
                  head: Any, count_hits: bool = True, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``model`` on ``inputs`` whose output head returns per-sequence target log-prob sums and argmax
    hits (:func:`finetune.tasks.losses.sequence_logprobs`, at ``temperature``: GRPO scores its completions at the
    temperature they were sampled at) instead of ``[tokens x vocab]`` logits.

    The head module's ``forward`` is replaced for the call, so the loss runs inside the model's own forward: every
    wrapper's hooks (DDP, FSDP's unshard and reshard, DeepSpeed ZeRO-3's parameter gathering, autocast, peft) see
    the head called as usual, and the sums come out as the output's ``logits``, which carry the wrappers' backward
    hooks. A plain ``nn.Linear`` head (tied or not) takes the fused chunked path; any other module (a LoRA-adapted
    head) is called chunk by chunk. A model that alters the head's output afterwards (logit soft-capping) would make
    the sums wrong, so it is refused."""
    own = vars(head).get("forward")
    original = own if own is not None else type(head).forward.__get__(head)
    picked: dict[str, torch.Tensor] = {}

    @torch.compiler.disable  # train.compile: run eagerly, a graph break after the body (inductor cannot lower it)
    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or hidden.shape[:-1] != targets.shape:
            raise RuntimeError(f"output head {type(head).__name__} was called with {tuple(hidden.shape)}, "
                               f"expected the final hidden states {tuple(targets.shape)} + (hidden,)")
        flat = hidden.reshape(-1, hidden.size(-1))
        # a Linear's own forward (FSDP2's FSDPLinear keeps it): fused; an override (LoRA, quantised): the module
        fused = isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
        picked["sums"], picked["hits"] = sequence_logprobs(
            flat, targets.reshape(-1), seq, sequences, weight=head.weight if fused else None,
            bias=head.bias if fused else None, head=None if fused else original, count_hits=count_hits,
            temperature=temperature)
        return picked["sums"]

    head.forward = forward
    try:
        out = model(**inputs)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    sums = out.logits if hasattr(out, "logits") else out
    # the head's own result, or a view of it (DeepSpeed ZeRO-3 hands on a detached alias); never a new tensor
    if "sums" not in picked or not isinstance(sums, torch.Tensor) or sums.shape != picked["sums"].shape \
            or not torch._C._is_alias_of(sums, picked["sums"]):
        raise ConfigError(f"the model's forward {'never called' if 'sums' not in picked else 'changed what'} its "
                          f"output head ({type(head).__name__}) {'' if 'sums' not in picked else 'returned '}(e.g. "
                          "logit soft-capping), so the loss cannot be computed from the head's input; set the row's "
                          "output_head=None to compute it from the logits")
    return sums, picked["hits"]


def answer_logprobs(model: Any, inputs: dict[str, Any], targets: torch.Tensor, head_name: str | None,
                    per_sequence: bool, count_hits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-prob sums and argmax hits of a batch's ``[S, T]`` next-token ``targets``: per sequence (``[S]``,
    DPO) or over the whole batch (``[1]``, SFT's summed loss is minus it). Computed from the final hidden states and
    the row's output head (:func:`head_logprobs`) when the model has one, else from the model's logits, chunk by
    chunk either way; no host sync. Hits are counted only with ``count_hits`` (zeros otherwise)."""
    sequences, length = targets.shape
    seq = (torch.arange(sequences, device=targets.device)[:, None].expand(sequences, length).reshape(-1)
           if per_sequence else torch.zeros(sequences * length, dtype=torch.long, device=targets.device))
    count = sequences if per_sequence else 1
    head = find_head(model, head_name)
    if head is not None:
        return head_logprobs(model, inputs, targets, seq, count, head, count_hits)
    out = model(**inputs)
    logits = out.logits if hasattr(out, "logits") else out
    return sequence_logprobs(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), seq, count,
                             count_hits=count_hits)


def greedy_generate(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int,
                    eos_id: int | None, pad_id: int) -> torch.Tensor:
    """Greedy decoding with a KV cache from left-padded prompts; returns the new tokens (pad after eos). Always
    ``max_new_tokens`` forward passes, so the ranks of a sharded backend stay in lockstep (exact_match)."""
    return generate_tokens(model, prompt_ids, prompt_mask, max_new_tokens, [] if eos_id is None else [eos_id], pad_id)


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
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True)
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
                    **_kv_cache(out))
    return torch.stack(new_tokens, dim=1)


def _kv_cache(out: Any) -> dict[str, Any]:
    """The KV cache of a forward's output, as the keyword argument the model takes it back by: ``cache`` since
    transformers 5.24 (which deprecates ``past_key_values`` both ways, with a warning), else ``past_key_values``."""
    # transformers' ModelOutput is a mapping; any other output object (a custom row's, a test double) has attributes
    cache = out.get("cache") if isinstance(out, Mapping) else getattr(out, "cache", None)
    return {"cache": cache} if cache is not None else {"past_key_values": out.past_key_values}


class CausalLMTask(TaskData):
    """Formats alpaca / chat / completion; the prompt is masked unless ``data.train_on_prompt``.

    The forward gets the batch keys the recipe's row lists in ``model_inputs`` (a custom row's forward may take
    fewer than a Hugging Face model's), plus ``use_cache=False`` for Hugging Face rows only."""

    def __init__(self, *args: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer = tokenizer
        row = self.row  # None: a hand-made config of the task's own fields (an HF model)
        self.model_inputs: tuple[str, ...] = row.model_inputs if row is not None else registry.MODEL_INPUTS
        self.forward_flags: dict[str, Any] = {} if row is not None and row.factory else {"use_cache": False}
        self.output_head = row.output_head if row is not None else registry.OUTPUT_HEAD

    def _logits(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The full logits of a batch (tests and probes; the loss never builds them: :meth:`_answer`). A padded
        batch has an attention mask; a packed one (data.packing) position ids and no mask (None). Never a KV cache:
        with one, transformers skips the packed-sequence detection and samples attend to each other."""
        out = model(**self._inputs(batch))
        return out.logits if hasattr(out, "logits") else out

    def _inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The forward's keyword arguments: the row's ``model_inputs`` from the batch and the forward flags."""
        return {**{key: batch.get(key) for key in self.model_inputs}, **self.forward_flags}

    def _answer(self, model: Any, batch: dict[str, Any],
                count_hits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The summed next-token loss (fp32), the argmax hits (with ``count_hits``) and the number of targets of a
        batch, from the final hidden states and the output head chunk by chunk (:func:`answer_logprobs`)."""
        targets = next_token_targets(batch["labels"])
        sums, hits = answer_logprobs(model, self._inputs(batch), targets, self.output_head, per_sequence=False,
                                     count_hits=count_hits)
        return -sums.sum(), hits.sum(), (targets != IGNORE).sum()

    def count_targets(self, batch: dict[str, Any]) -> int:
        """Next-token targets (a packed batch marks each sample's first label IGNORE, so the count is the same)."""
        return count_next_token_targets(batch["labels"])

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        return self._answer(model, batch)[0]

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts:
        metrics = self.cfg.eval.metrics
        loss_sum, hits, num_tokens = self._answer(model, batch, count_hits="token_accuracy" in metrics)
        counts = EvalCounts(loss_sum, num_tokens)
        if "token_accuracy" in metrics:
            counts.correct["token_accuracy"], counts.total["token_accuracy"] = hits, num_tokens
        if "exact_match" in metrics:
            counts.correct["exact_match"] = torch.tensor(self._exact_matches(model, batch), device=hits.device)
            counts.total["exact_match"] = torch.tensor(len(batch["reference"]), device=hits.device)
        return counts

    def _generate(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The greedy answer tokens of the batch's prompts (``eval.max_new_tokens`` of them, pad after eos)."""
        return greedy_generate(model, batch["prompt_ids"], batch["prompt_mask"], self.cfg.eval.max_new_tokens,
                               self.tokenizer.eos_token_id, self.pad_id)

    def _exact_matches(self, model: Any, batch: dict[str, Any]) -> int:
        eos = self.tokenizer.eos_token_id
        new = self._generate(model, batch)
        hits = 0
        for tokens, reference in zip(new.tolist(), batch["reference"], strict=True):
            if eos in tokens:
                tokens = tokens[: tokens.index(eos)]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            hits += normalize(text) == normalize(reference)
        return hits
