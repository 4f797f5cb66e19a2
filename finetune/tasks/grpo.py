"""Group relative policy optimisation (``task: grpo``): online RL from rewards through the same seam as SFT.

A step's global batch is ``train.global_batch_size`` PROMPTS (``micro_batch_size`` prompts per micro-batch); each
prompt gives ``grpo.group_size`` completions sampled from the policy itself. The train dataloader of this task
(:class:`Rollouts`) is an iterator that, for each generation cycle, takes this rank's prompts of every micro-batch
of the window, generates their completions with the current weights (eval mode, KV cache, left-padded), scores
the rewards on the host, normalises advantages within each group, scores the old log-probs (``iterations`` > 1)
and the reference log-probs (``beta`` > 0), and yields micro-batches of prompt + completion sequences whose
targets are the completion tokens up to and including the first EOS.

Per completion token t, with ``r_t = exp(logp_t - old_t)`` (``old_t = logp_t.detach()`` when ``iterations`` is 1,
so ``r_t`` is 1 with the policy gradient's derivative) and the k3 estimator of the KL to the reference
``KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``::

    l_t = -min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon) A) + beta KL_t

Every log-prob here (``logp_t``, ``old_t`` and ``ref_t``) is scored at the temperature T the completions were sampled
at (``grpo.temperature``): ``log_softmax(logits / T)`` at the completion's token, the distribution the sampler drew
it from (:func:`completion_logprobs`; TRL scores its per-token log-probs the same way). Scoring the raw logits instead
would make the ratio, its clip and the KL those of another policy than the one that generated, and the gradient
differ from the sampler's policy gradient whenever T != 1.

Normalisation (``grpo.loss``), exactly, over the whole accumulation window on all ranks (the loop's one division:
``train_output`` returns the sum, ``count_targets`` the denominator's share of the micro-batch):

* ``grpo``: each completion's mean over its tokens, then the mean over the window's completions
  (targets = completions);
* ``token``: the sum over every completion token of the window / the window's completion tokens
  (targets = completion tokens);
* ``dr_grpo``: the sum over every completion token / (completions x ``max_new_tokens``), and the advantage
  without the group's std (targets = completions x max_new_tokens).

Advantages: ``A = (r - mean_group) / std_group`` (sample std) for ``grpo`` and ``token``; ``r - mean_group`` for
``dr_grpo``; a group whose rewards are all equal gets advantage 0 (and is counted in ``frac_zero_std``).

Reproducibility: completion ``j`` of the prompt at position ``p`` of the global batch of generation step ``s`` is
drawn from its own CPU generator seeded by ``(train.seed, s, p, j)`` (:func:`completion_seed`), one uniform draw
per new token (:class:`finetune.tasks.decoding.Sampling`), so it does not depend on the micro-batch size, the
batch composition or the number of processes. ``iterations`` k > 1: one generation batch serves k consecutive
optimizer steps; the loop still counts ``global_batch_size`` samples per step, so ``samples_seen`` advances k
times per generation batch and the prompt cursor is ``(samples_seen // (k G)) G``. An epoch is one pass over the
prompts whatever k is: ``train.epochs`` gives k x the prompt batches of its passes in optimizer steps, and an
epoch is k x the rows in ``samples_seen`` (:func:`finetune.storage.state.epoch_samples`). A checkpoint written inside a
cycle saves the cycle's generated batch (``grpo_rollouts``, in global prompt order, so any world size reads it);
one at a cycle's end saves nothing, and a resume regenerates from the seeds.

The reference (``beta`` > 0): with LoRA the model with its adapter disabled; with full fine-tuning a frozen copy of
the initial weights that the worker's backend makes (:func:`finetune.backends.frozen_copy`, taken in
:meth:`GRPOTask.prepare`, before a resume loads a checkpoint, and never saved): a deep copy where parameters are
whole (one process, DDP, ZeRO-1/2); on FSDP2 / ZeRO-3 each rank's shards of it, swapped into the policy for the
reference's forward passes (sharded as the policy, in lockstep); FSDP1 is refused when the recipe is validated.

The generator is a seam (:class:`Generator`): the policy generates here (:class:`PolicyGenerator`); an external
engine (vLLM on a GPU, fed the current weights) would implement ``complete`` with the same seeds.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from finetune.data.formats import stop_ids
from finetune.data.prompt_rows import PromptCollator
from finetune.data.rows import IGNORE
from finetune.errors import ConfigError, FinetuneError, RunDirError
from finetune.tasks.base import EvalCounts, TaskData
from finetune.tasks.causal_lm import answered
from finetune.tasks.decoding import Sampling, answers, generate_tokens
from finetune.tasks.logprobs import Forward, OutputHead, next_token_targets, target_logprobs
from finetune.tasks.rewards import build_rewards

CACHE_NAME = "grpo_rollouts"  # the checkpoint object holding a generation batch that a later step still uses


def completion_seed(seed: int, step: int, position: int, completion: int) -> int:
    """The seed of one completion's generator: a hash of (train.seed, generation step, the prompt's position in
    the step's global batch, the completion's number in its group), so nearby tuples give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{step}:{position}:{completion}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def batch_position(rank: int, world: int, global_batch: int, micro_batch: int, micro: int) -> int:
    """The position in its step's global batch of the first row of micro-batch ``micro`` of rank ``rank`` (each
    rank takes a contiguous ``global_batch / world`` of the step's rows, micro-batch after micro-batch): what a
    completion's seed is keyed by, so it does not depend on the micro-batch size or the number of processes."""
    return rank * (global_batch // world) + micro * micro_batch


class Generator(Protocol):
    """Where completions come from. ``prompt_ids`` / ``prompt_mask`` ``[N, L]`` are left-padded (one row per
    completion, a prompt repeated ``group_size`` times), ``seeds`` one per row; returns ``[N, max_new_tokens]``
    token ids, pad after each row's first stop token. A row's tokens depend on its prompt, its seed and the
    weights only. An external engine (vLLM on a GPU) implements this with the policy's current weights."""

    def complete(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
        ...


class PolicyGenerator:
    """Generation with the policy itself: eval mode (no dropout), the recipe's autocast, a KV cache, one seeded
    generator per row (:func:`finetune.tasks.decoding.generate_tokens`); ``lockstep`` (sharded parameters): every
    call runs ``max_new_tokens`` forward passes on every rank, else it ends once every row has stopped."""

    def __init__(self, model: Any, precision: Any, *, max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: Sequence[int], pad_id: int, lockstep: bool) -> None:
        self.model, self.precision = model, precision
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop_ids, self.pad_id, self.lockstep = list(stop_ids), pad_id, lockstep

    def complete(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
        sampling = None if self.temperature <= 0 else Sampling(
            self.temperature, self.top_p, [torch.Generator().manual_seed(s) for s in seeds])
        was_training = self.model.training
        self.model.eval()
        try:
            with self.precision.autocast():
                new = generate_tokens(self.model, prompt_ids, prompt_mask, self.max_new_tokens, self.stop_ids,
                                      self.pad_id, sampling, stop_when_done=not self.lockstep)
        finally:
            self.model.train(was_training)
        return pad_columns(new, self.max_new_tokens, self.pad_id)


def pad_columns(tokens: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    """``tokens`` ``[N, <= width]`` right-padded with ``pad_id`` to ``width`` columns."""
    return torch.nn.functional.pad(tokens, (0, width - tokens.size(1)), value=pad_id)


def completion_mask(tokens: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """1 on each row's tokens up to and including its first stop token (every token when it has none), else 0."""
    if not len(stop_ids):
        return torch.ones_like(tokens, dtype=torch.long)
    stops = torch.isin(tokens, torch.tensor(list(stop_ids), dtype=tokens.dtype, device=tokens.device)).long()
    before = stops.cumsum(-1) - stops  # stop tokens strictly before each position
    return (before == 0).long()


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion (``rewards`` ``[N]``, groups of ``group_size`` consecutive rows): ``r - mean`` of its group,
    divided by the group's sample std when ``scale``; 0 in a group whose rewards are all equal. Also whether each
    group's std is 0 (``[N / group_size]``). float64."""
    groups = rewards.double().reshape(-1, group_size)
    centred = groups - groups.mean(1, keepdim=True)
    std = groups.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
    flat = std == 0
    advantage = torch.where(flat, 0.0, centred / std.where(~flat, 1.0) if scale else centred)
    return advantage.reshape(-1), flat.reshape(-1)


def token_logprobs(model: Any, inputs: dict[str, Any], targets: torch.Tensor, head_name: OutputHead | str | None,
                   temperature: float = 1.0) -> torch.Tensor:
    """``[S, T]`` fp32: the log-prob of each next-token target at ``temperature`` (0 where IGNORE), with grad when
    enabled: the shared primitive :func:`finetune.tasks.logprobs.target_logprobs` summed per target token (no
    ``[tokens x vocab]`` logits)."""
    sums = target_logprobs(model, inputs, targets, head_name, per="token", temperature=temperature).sums
    return sums.reshape(targets.shape)


@dataclass
class Rollout:
    """One micro-batch of prompts and their completions (host tensors, ``N = prompts x group_size`` rows in
    group order): the collated prompts, the completion ids ``[N, M]``, the unweighted rewards ``[F, N]``, and the
    old and reference log-probs ``[N, M]`` when they are needed."""

    prompts: dict[str, Any]
    completions: torch.Tensor
    rewards: torch.Tensor
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None


def sequences(prompts: dict[str, Any], completions: torch.Tensor, group_size: int, stop_ids: Sequence[int],
              pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + completion rows: ``input_ids``, ``attention_mask`` (prompt padding and everything after a stop
    token hidden), ``position_ids`` (each row's real tokens counted), ``labels`` (completion tokens up to and
    including the stop token, IGNORE elsewhere) and ``completion_mask`` ``[N, M]``."""
    prompt_ids = prompts["prompt_ids"].repeat_interleave(group_size, 0)
    prompt_mask = prompts["prompt_mask"].repeat_interleave(group_size, 0).long()
    mask = completion_mask(completions, stop_ids)
    attention = torch.cat([prompt_mask, mask], dim=1)
    labels = torch.cat([torch.full_like(prompt_ids, IGNORE), torch.where(mask.bool(), completions, IGNORE)], dim=1)
    return {"input_ids": torch.cat([prompt_ids, torch.where(mask.bool(), completions, pad_id)], dim=1),
            "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "labels": labels,
            "completion_mask": mask}


def completion_logprobs(model: Any, batch: dict[str, Any], forward: Forward, temperature: float = 1.0) -> torch.Tensor:
    """``[N, M]``: the log-prob of each completion token of a :func:`sequences` batch (0 after its stop) at
    ``temperature``: the policy's, the old and the reference's log-probs are all scored at ``grpo.temperature``, the
    one the completions were sampled at (see the module docstring)."""
    targets = next_token_targets(batch["labels"])
    width = batch["completion_mask"].size(1)
    start = batch["input_ids"].size(1) - width - 1  # the position whose target is the first completion token
    return token_logprobs(model, forward.inputs(batch), targets, forward.head, temperature)[:, start:start + width]


def policy_loss(logp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, advantage: torch.Tensor,
                mask: torch.Tensor, epsilon: float, beta: float, kind: str,
                max_new_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's loss SUM under ``kind``'s normalisation (see the module docstring; the loop divides by
    the window's targets) and the sums behind the step's metrics (clipped tokens, KL, tokens)."""
    mask_f = mask.to(logp.dtype)
    ratio = torch.exp(logp - old)
    a = advantage.to(logp.dtype)[:, None]
    unclipped, clipped = ratio * a, ratio.clamp(1.0 - epsilon, 1.0 + epsilon) * a
    per_token = -torch.minimum(unclipped, clipped)
    stats = {"clipped": ((clipped < unclipped).to(logp.dtype) * mask_f).sum().detach(), "tokens": mask_f.sum()}
    if ref is not None and beta > 0:
        delta = ref.to(logp.dtype) - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + beta * kl
        stats["kl"] = (kl * mask_f).sum().detach()
    masked = per_token * mask_f
    if kind == "grpo":
        loss = (masked.sum(1) / mask_f.sum(1).clamp(min=1.0)).sum()
    elif kind in ("token", "dr_grpo"):
        loss = masked.sum()
    else:
        raise ValueError(f"unknown grpo loss {kind!r}")
    return loss, stats


def targets_of(kind: str, mask: torch.Tensor, max_new_tokens: int) -> int:
    """The micro-batch's share of the loop's one division under ``kind``: completions (``grpo``), completion
    tokens (``token``), completions x ``max_new_tokens`` (``dr_grpo``)."""
    completions = mask.size(0)
    if kind == "grpo":
        return completions
    if kind == "token":
        return int(mask.sum())
    return completions * max_new_tokens


@dataclass(frozen=True)
class SumLayout:
    """The named parts of one float64 vector of sums, in order: how a rank packs its sums for one all-reduce and
    how the summed vector is read back by name, written once here so that no other code counts positions."""

    parts: tuple[tuple[str, int], ...]  # (name, width), in the vector's order

    def pack(self, sums: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """``sums`` (exactly the layout's names, each a tensor of its part's width) as one float64 vector on
        ``device``; a ValueError names a missing, extra or misshapen part (a producer out of step with the layout)."""
        if set(sums) != {name for name, _ in self.parts}:
            raise ValueError(f"sums {sorted(sums)} do not match the layout's parts {[n for n, _ in self.parts]}")
        pieces = [torch.as_tensor(sums[name], dtype=torch.float64).reshape(-1).to(device) for name, _ in self.parts]
        for (name, width), piece in zip(self.parts, pieces, strict=True):
            if piece.numel() != width:
                raise ValueError(f"sum {name!r} has {piece.numel()} value(s), the layout {width}")
        return torch.cat(pieces)

    def unpack(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts of a packed vector (e.g. summed over ranks) by name, each a view of its width."""
        widths = [width for _, width in self.parts]
        if vector.numel() != sum(widths):
            raise ValueError(f"a vector of {vector.numel()} sums, the layout has {sum(widths)}")
        return dict(zip([name for name, _ in self.parts], vector.split(widths), strict=True))


def generation_layout(functions: int, max_new_tokens: int) -> SumLayout:
    """The generation metrics' sums of a window (:meth:`GRPOTask.rollout_sums`, read by
    :func:`generation_metrics`): the rewards' sums and sums of squares (each of the ``functions`` reward functions,
    then their weighted total), the completions, the groups whose totals are all equal, the groups, the completion
    tokens, the truncated completions (``max_new_tokens`` tokens, no stop) and the completions by length (0 to
    ``max_new_tokens``). Every part is a sum over completions, so the sum over ranks is the step's."""
    counts = ("completions", "zero_std_groups", "groups", "completion_tokens", "truncated")
    return SumLayout((("reward", functions + 1), ("reward_squared", functions + 1),
                      *((name, 1) for name in counts), ("length_histogram", max_new_tokens + 1)))


LOSS_SUMS = ("clipped", "kl", "tokens")  # the sums of policy_loss's stats that the step's metrics read


def step_layout(functions: int, max_new_tokens: int) -> SumLayout:
    """What :meth:`GRPOTask.step_metrics` all-reduces in one call: the generation metrics' sums of the batch that
    served the step (:func:`generation_layout`), then the step's loss sums (:data:`LOSS_SUMS`)."""
    return SumLayout(generation_layout(functions, max_new_tokens).parts + tuple((name, 1) for name in LOSS_SUMS))


class RolloutState:
    """The rollout state that GRPO's parts share, owned here and written only through these methods. The task makes
    one; :class:`Rollouts` (the train dataloader) holds the cycle's live batch in it and serves each step's
    generation metrics through it, :class:`RolloutCache` (the checkpoint object) saves the live batch and hands a
    read-back one to it, and :meth:`GRPOTask.step_metrics` reads the served metrics. One owner, so that no part
    writes another's attributes."""

    def __init__(self) -> None:
        self._live: tuple[int, list[Rollout]] | None = None  # (cycle, window) while a later step uses it
        self._served: dict[str, torch.Tensor] | None = None  # generation_layout's sums of the serving batch
        self._restored: tuple[int, torch.Tensor] | None = None  # (cycle, gathered rows) read from a checkpoint

    def hold(self, cycle: int, window: list[Rollout]) -> None:
        """Keep ``window``, the generation batch of ``cycle``, while a later step of the cycle still trains on it
        (a checkpoint now saves it)."""
        self._live = (cycle, window)

    def release(self) -> None:
        """No later step uses the live batch (a cycle's last step, a fresh iterator): a checkpoint saves none."""
        self._live = None

    def live(self) -> tuple[int, list[Rollout]] | None:
        """The held ``(cycle, window)``, or None."""
        return self._live

    def serve(self, sums: dict[str, torch.Tensor]) -> None:
        """Record the generation metrics' sums (:func:`generation_layout`'s parts, host tensors) of the batch that
        serves the steps from now on, for their train rows."""
        self._served = sums

    def served(self) -> dict[str, torch.Tensor]:
        """The sums :meth:`serve` last recorded; a RuntimeError when no batch has served a step yet."""
        if self._served is None:
            raise RuntimeError("a step was taken without a generation batch")
        return self._served

    def restore(self, cycle: int, rows: torch.Tensor) -> None:
        """Keep a checkpoint's generation batch (``rows``: :meth:`GRPOTask.cache_rows` gathered over the ranks,
        generated for ``cycle``) until the train dataloader takes it."""
        self._restored = (cycle, rows)

    def take_restored(self) -> tuple[int, torch.Tensor] | None:
        """The restored ``(cycle, rows)``, once (then None): only the first generation after a resume reads it."""
        restored, self._restored = self._restored, None
        return restored


class GRPOTask(TaskData):
    """``task: grpo`` over ``data.format: prompt`` rows (see the module docstring). Eval: greedy completions of
    ``grpo.max_new_tokens`` tokens on the eval prompts, ``exact_match`` against each row's ``answer`` (sums and
    counts) and the mean total ``reward``; no eval loss or perplexity is logged (a policy-gradient loss on greedy
    completions has no meaning)."""

    eval_loss = False
    perplexity = False
    eval_means = ("reward",)

    def __init__(self, *args: Any, tokenizer: Any, allow_plugin: bool = False,
                 frozen_copy: Callable[[Any], tuple[Any, Callable[[], Any]]] | None = None, **kwargs: Any) -> None:
        """``allow_plugin``: a ``function`` reward may be imported (what the command line allowed, as for
        ``model.plugin``: ``finetune run`` always, a stored run's recipe with ``--trust-remote-code``).
        ``frozen_copy``: the backend's frozen copy of the prepared model's weights, as (the module that scores with
        it, a factory of the context it scores in) (the worker's ``finetune.backends.frozen_copy``; sharded
        like the policy on FSDP2 / ZeRO-3); None: a deep copy, refused where parameters are sharded."""
        super().__init__(*args, **kwargs)
        self.tokenizer, self.allow_plugin, self.frozen_copy = tokenizer, allow_plugin, frozen_copy
        self.stop_ids: list[int] = stop_ids(tokenizer)  # eos, and the chat template's end of turn
        self.model: Any = None
        self.accelerator: Any = None
        self.precision: Any = None
        self.rewards: Any = None
        self.reference: Any = None  # scores with a frozen copy of the initial weights (full fine-tuning, beta > 0)
        self.reference_context: Callable[[], Any] = nullcontext  # ... inside this (the copy's shards swapped in)
        self.generator: Generator | None = None
        self.rollout_state = RolloutState()  # shared by the train dataloader and the checkpoint object
        self._sums: dict[str, torch.Tensor] = {}  # this step's train_output sums (device tensors, no sync)

    # ------------------------------------------------------------------ the hand-over and the protocol

    @property
    def checkpoint_objects(self) -> dict[str, Any]:
        """What a checkpoint must hold besides the model: the generation batch a later step still uses."""
        return {CACHE_NAME: RolloutCache(self, self.rollout_state)}

    def prepare(self, initial: Callable[[], Any], accelerator: Any, precision: Any, log: Callable[[str], None],
                splits: tuple[str, ...] = ("train", "eval")) -> None:
        """Build the reward functions; when the run trains (``splits`` holds train), bind the prepared model (it
        generates), the accelerator and the precision, and with full fine-tuning and ``beta`` > 0 keep a frozen copy
        of the initial weights as the reference (this runs before a resume loads a checkpoint, so the copy is the
        initial model)."""
        grpo = self.cfg.grpo
        self.accelerator, self.precision = accelerator, precision
        self.rewards = build_rewards(self.cfg, device=accelerator.device, log=log, allow_plugin=self.allow_plugin)
        if "train" not in splits:  # finetune eval: the loop hands eval_output its model; none is built here
            return
        self.model = initial()
        self.generator = PolicyGenerator(self.model, precision, max_new_tokens=grpo.max_new_tokens,
                                         temperature=grpo.temperature, top_p=grpo.top_p, stop_ids=self.stop_ids,
                                         pad_id=self.pad_id, lockstep=self.lockstep)
        unwrapped = accelerator.unwrap_model(self.model)
        if grpo.beta > 0 and not hasattr(unwrapped, "disable_adapter"):
            if self.frozen_copy is not None:
                self.reference, self.reference_context = self.frozen_copy(self.model)
            elif self.lockstep:
                raise ConfigError("grpo.beta > 0 with full fine-tuning needs a frozen reference copy, which needs "
                                  "the backend's copy where parameters are sharded; use peft (LoRA: the reference "
                                  "is the base with the adapter disabled) or grpo.beta=0")
            else:
                self.reference = copy.deepcopy(unwrapped).requires_grad_(False).eval()
            log("grpo: reference = a frozen copy of the initial weights (grpo.beta > 0, full fine-tuning)"
                + (", sharded as the policy" if self.reference is self.model else ""))

    def build_dataloader(self, split: str, start_sample: int = 0) -> Any:
        """``train``: :class:`Rollouts` from the data cursor ``start_sample``; ``eval``: this rank's prompts."""
        if split != "train":
            return super().build_dataloader(split, start_sample)
        if self.model is None:
            raise RuntimeError("task grpo: prepare() must bind the model before training")
        return Rollouts(self, self.rollout_state, start_sample)

    def prompt_loader(self, start_prompt: int) -> Any:
        """This rank's micro-batches of prompts from stream position ``start_prompt`` (TaskData's train stream)."""
        return TaskData.build_dataloader(self, "train", start_prompt)

    def train_collator(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        return PromptCollator(self.pad_id)

    def eval_collator(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        return PromptCollator(self.pad_id)

    def count_samples(self, batch: dict[str, Any]) -> int:
        """One sample per prompt."""
        return len(batch["prompt_ids"])

    def count_targets(self, batch: dict[str, Any]) -> int:
        return targets_of(self.cfg.grpo.loss, batch["completion_mask"], self.cfg.grpo.max_new_tokens)

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The loss sum of a rollout micro-batch (see :func:`policy_loss`); its metric sums are kept for
        :meth:`step_metrics`."""
        grpo = self.cfg.grpo
        logp = completion_logprobs(model, batch, self.forward, grpo.temperature)
        old = batch["old_logps"] if "old_logps" in batch else logp.detach()
        loss, stats = policy_loss(logp, old.to(logp.dtype), batch.get("ref_logps"), batch["advantages"],
                                  batch["completion_mask"], grpo.epsilon, grpo.beta, grpo.loss, grpo.max_new_tokens)
        for key, value in stats.items():
            self._sums[key] = self._sums.get(key, 0.0) + value.double()
        return loss

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The step's metrics over every rank, from one all-reduce of sums and counts: rewards (mean and std of
        each function and of the total), the fraction of groups with zero std, completion length (mean, max),
        the truncated fraction, the clip fraction and (``beta`` > 0) the mean per-token KL."""
        device = self.accelerator.device if self.accelerator is not None else torch.device("cpu")
        names = list(self.rewards.names)
        layout = step_layout(len(names), self.cfg.grpo.max_new_tokens)
        zero = torch.zeros((), dtype=torch.float64)
        local = self.rollout_state.served() | {name: self._sums.get(name, zero) for name in LOSS_SUMS}
        summed = layout.unpack(reduce(layout.pack(local, device)).double().cpu())
        self._sums = {}
        return generation_metrics(summed, names) | loss_metrics(summed, self.cfg.grpo.beta > 0)

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts:
        """Greedy completions: exact_match against ``answer`` (whitespace-normalised) and the summed reward."""
        grpo = self.cfg.grpo
        with torch.no_grad():
            new = generate_tokens(model, batch["prompt_ids"], batch["prompt_mask"], grpo.max_new_tokens,
                                  self.stop_ids, self.pad_id, None, stop_when_done=not self.lockstep)
        texts = self.decode(new)
        device = new.device
        counts = EvalCounts(torch.zeros((), device=device), torch.tensor(float(len(texts)), device=device))
        rows = batch["rows"]
        if "exact_match" in self.cfg.eval.metrics:
            counts.correct["exact_match"] = torch.tensor(float(answered(texts, rows)), device=device)
            counts.total["exact_match"] = torch.tensor(float(len(texts)), device=device)
        if batch.get("filler"):  # lockstep filler: generated for the collectives, never scored
            counts.means["reward"] = (torch.zeros((), device=device), torch.zeros((), device=device))
            return counts
        total = self.rewards.total(self.rewards.score(list(batch["prompts"]), texts, list(rows),
                                                      batch["templated"]))
        counts.means["reward"] = (torch.tensor(float(sum(total)), device=device),
                                  torch.tensor(float(len(total)), device=device))
        return counts

    # ------------------------------------------------------------------ rollouts

    def decode(self, tokens: torch.Tensor) -> list[str]:
        """Each row's text up to (not including) its first stop token, special tokens skipped."""
        return answers(tokens, self.stop_ids, self.tokenizer)

    def rollout(self, prompts: dict[str, Any], step: int, first_position: int,
                restored: torch.Tensor | None = None) -> Rollout:
        """Completions of one micro-batch of prompts (generated, or ``restored`` rows from a checkpoint), their
        rewards, and the old / reference log-probs the loss needs."""
        grpo, device = self.cfg.grpo, self.accelerator.device
        group, width = grpo.group_size, grpo.max_new_tokens
        names = list(self.rewards.names)
        if restored is not None:
            completions = restored[:, :width].long()
            rewards = restored[:, width:width + len(names)].T.contiguous()
            rollout = Rollout(prompts, completions, rewards)
            rest = restored[:, width + len(names):]
            if grpo.iterations > 1:
                rollout.old, rest = rest[:, :width].float(), rest[:, width:]
            if grpo.beta > 0:
                rollout.ref = rest[:, :width].float()
            return rollout
        ids = prompts["prompt_ids"].repeat_interleave(group, 0).to(device)
        mask = prompts["prompt_mask"].repeat_interleave(group, 0).to(device)
        seeds = [completion_seed(self.cfg.train.seed, step, first_position + i // group, i % group)
                 for i in range(ids.size(0))]
        assert self.generator is not None
        completions = self.generator.complete(ids, mask, seeds).cpu()
        texts = self.decode(completions)
        rows = [row for row in prompts["rows"] for _ in range(group)]
        texts_prompts = [p for p in prompts["prompts"] for _ in range(group)]
        templated = [chat for chat in prompts["templated"] for _ in range(group)]
        scores = self.rewards.score(texts_prompts, texts, rows, templated)
        rollout = Rollout(prompts, completions, torch.tensor(scores, dtype=torch.float64).reshape(len(names), -1))
        if grpo.iterations > 1 or grpo.beta > 0:
            batch = {k: v.to(device) for k, v in sequences(prompts, completions, group, self.stop_ids,
                                                           self.pad_id).items()}
            if grpo.iterations > 1:
                rollout.old = self.score(self.model, batch, nullcontext()).cpu()
            if grpo.beta > 0:
                reference, context = self.reference_model()
                rollout.ref = self.score(reference, batch, context).cpu()
        return rollout

    def reference_model(self) -> tuple[Any, Any]:
        """The reference and the context it scores in: the frozen copy, or (LoRA) the model, adapter disabled."""
        if self.reference is not None:
            return self.reference, self.reference_context()
        unwrapped = self.accelerator.unwrap_model(self.model)
        return self.model, unwrapped.disable_adapter() if hasattr(unwrapped, "disable_adapter") else nullcontext()

    def score(self, model: Any, batch: dict[str, Any], context: Any) -> torch.Tensor:
        """Completion-token log-probs under ``model`` at ``grpo.temperature`` (as the policy's in
        :meth:`train_output`), in eval mode, no gradient, the recipe's autocast."""
        was_training = model.training
        model.eval()
        try:
            with context, torch.no_grad(), self.precision.autocast():
                return completion_logprobs(model, batch, self.forward, self.cfg.grpo.temperature).float()
        finally:
            model.train(was_training)

    def micro_batch(self, rollout: Rollout) -> dict[str, Any]:
        """A rollout as the loop's micro-batch: the :func:`sequences` tensors, the advantages, old and reference
        log-probs (host tensors)."""
        grpo = self.cfg.grpo
        batch: dict[str, Any] = sequences(rollout.prompts, rollout.completions, grpo.group_size, self.stop_ids,
                                          self.pad_id)
        total = torch.tensor(self.rewards.total(rollout.rewards.tolist()), dtype=torch.float64)
        batch["advantages"], _ = group_advantages(total, grpo.group_size, scale=grpo.loss != "dr_grpo")
        batch["advantages"] = batch["advantages"].float()
        if rollout.old is not None:
            batch["old_logps"] = rollout.old
        if rollout.ref is not None:
            batch["ref_logps"] = rollout.ref
        return batch

    def rollout_sums(self, rollouts: list[Rollout]) -> dict[str, torch.Tensor]:
        """The generation metrics' sums of a window's rollouts on this rank, by the names of
        :func:`generation_layout` (float64 host tensors; see :func:`generation_metrics`)."""
        rewards = torch.cat([r.rewards for r in rollouts], dim=1)  # [F, N]
        total = torch.tensor(self.rewards.total(rewards.tolist()), dtype=torch.float64)
        _, flat = group_advantages(total, self.cfg.grpo.group_size, scale=True)
        per = torch.cat([rewards, total[None]])  # [F + 1, N]: each function's reward, then the weighted total
        return {"reward": per.sum(1), "reward_squared": (per * per).sum(1), "completions": _count(len(total)),
                "zero_std_groups": _count(flat.sum()), "groups": _count(len(flat)),
                **self.length_sums(torch.cat([r.completions for r in rollouts]))}

    def length_sums(self, completions: torch.Tensor) -> dict[str, torch.Tensor]:
        """The length parts of :meth:`rollout_sums` for completion ids ``[N, max_new_tokens]``: their tokens up to
        the first stop, how many used every token without a stop (truncated), and how many have each length."""
        width = self.cfg.grpo.max_new_tokens
        lengths = completion_mask(completions, self.stop_ids).sum(1)
        stopped = torch.isin(completions, torch.tensor(self.stop_ids, dtype=completions.dtype)).any(1) \
            if self.stop_ids else torch.zeros(len(completions), dtype=torch.bool)
        histogram = torch.bincount(lengths, minlength=width + 1)[: width + 1].double()
        return {"completion_tokens": _count(lengths.sum()), "truncated": _count((~stopped & (lengths == width)).sum()),
                "length_histogram": histogram}

    def cache_rows(self, rollouts: list[Rollout]) -> torch.Tensor:
        """A window's rollouts as one float64 ``[N, columns]`` table (completion ids, rewards, old and reference
        log-probs), rows in this rank's order: what a mid-cycle checkpoint saves."""
        parts = []
        for r in rollouts:
            columns = [r.completions.double(), r.rewards.T.double()]
            columns += [t.double() for t in (r.old, r.ref) if t is not None]
            parts.append(torch.cat(columns, dim=1))
        return torch.cat(parts)


def _count(value: float | torch.Tensor) -> torch.Tensor:
    """A count as a one-value float64 sum (a part of width 1 of :func:`generation_layout`)."""
    return torch.tensor([float(value)], dtype=torch.float64)


def generation_metrics(summed: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, float]:
    """The train row's generation metrics from the sums of :meth:`GRPOTask.rollout_sums` (summed over the ranks)
    by the names of :func:`generation_layout`; ``names``: the reward functions', in their order in ``reward``."""
    n = float(summed["completions"])
    out: dict[str, float] = {}
    for i, name in enumerate([*names, None]):
        mean = float(summed["reward"][i]) / max(n, 1.0)
        std = math.sqrt(max(float(summed["reward_squared"][i]) / max(n, 1.0) - mean * mean, 0.0))
        key = "reward" if name is None else f"reward_{name}"
        out[key], out[f"{key}_std"] = mean, std
    nonzero = torch.nonzero(summed["length_histogram"]).flatten()
    out |= {"frac_zero_std": float(summed["zero_std_groups"]) / max(float(summed["groups"]), 1.0),
            "completion_len": float(summed["completion_tokens"]) / max(n, 1.0),
            "completion_len_max": float(nonzero[-1]) if len(nonzero) else 0.0,
            "truncated": float(summed["truncated"]) / max(n, 1.0)}
    return out


def loss_metrics(summed: Mapping[str, torch.Tensor], with_kl: bool) -> dict[str, float]:
    """The train row's clip fraction and (``with_kl``: ``beta`` > 0) mean per-token KL from the step's loss sums
    (:data:`LOSS_SUMS`, summed over the ranks)."""
    tokens = summed["tokens"].clamp(min=1.0)
    return {"clip_fraction": float(summed["clipped"] / tokens),
            **({"kl": float(summed["kl"] / tokens)} if with_kl else {})}


def cycle_at(start_sample: int, per_step: int, k: int) -> tuple[int, int]:
    """The generation cycle and the step within it (``offset``) of the data cursor ``start_sample`` (``per_step``
    samples per optimizer step, ``k`` = ``grpo.iterations`` steps per cycle); a ConfigError when the cursor is not a
    whole number of steps (a resume with another global batch)."""
    if start_sample % per_step:
        raise ConfigError(f"task grpo: the data cursor ({start_sample} samples) is not a whole number of steps "
                          f"of train.global_batch_size={per_step}; resume with the global batch it ran with")
    return divmod(start_sample // per_step, k)


def restored_cycle_problem(saved: int | None, cycle: int, offset: int, k: int) -> str | None:
    """Why a run resuming at step ``offset`` of generation cycle ``cycle`` cannot go on with the generation batch a
    checkpoint held (``saved``: the cycle it was generated for; None: it held none); None when it can. Inside a cycle
    the later steps train on the batch of that cycle, so the checkpoint must hold exactly that one; at a cycle's
    start the next step generates anew, whatever was saved."""
    if not offset:
        return None
    if saved is None:
        return (f"resuming inside a generation cycle (step {cycle * k + offset}, grpo.iterations={k}) needs the "
                "checkpoint's saved generation batch, which it does not hold")
    if saved != cycle:
        return f"the checkpoint's generation batch is of cycle {saved}, the run resumes inside cycle {cycle}"
    return None


class Rollouts:
    """The train dataloader of :class:`GRPOTask`: for each optimizer step, this rank's micro-batches of the
    window, generated at the first step of each cycle of ``grpo.iterations`` steps and served again for the
    others. ``start_sample`` is the loop's cursor (``global_batch_size`` per step)."""

    def __init__(self, task: GRPOTask, rollout_state: RolloutState, start_sample: int) -> None:
        """``rollout_state``: the task's, where the live batch is held, its metrics served and a checkpoint's batch
        taken from; a fresh iterator starts with no live batch."""
        cfg = task.cfg
        self.task, self.rollout_state = task, rollout_state
        self.per_step, self.k = cfg.train.global_batch_size, cfg.grpo.iterations
        self.cycle, self.offset = cycle_at(start_sample, self.per_step, self.k)
        self.prompts = iter(task.prompt_loader(self.cycle * self.per_step))
        rollout_state.release()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._batches()

    def _batches(self) -> Iterator[dict[str, Any]]:
        """Each step's micro-batches; the cycle's batch is held while a later step of the cycle still uses it."""
        while True:
            window = self._window()
            self.offset += 1
            if self.offset == self.k:  # the cycle's last step: the next one generates anew
                self.cycle, self.offset = self.cycle + 1, 0
                self.rollout_state.release()
            else:
                self.rollout_state.hold(self.cycle, window)
            for rollout in window:
                yield self.task.micro_batch(rollout)

    def _window(self) -> list[Rollout]:
        """The batch serving this step: the cycle's live one, else a new one whose metrics it serves from now on."""
        live = self.rollout_state.live()
        if live is not None:
            return live[1]
        window = self._generate()
        self.rollout_state.serve(self.task.rollout_sums(window))
        return window

    def _generate(self) -> list[Rollout]:
        """The cycle's rollouts: generated with the current weights, or read back from a checkpoint."""
        task, cfg = self.task, self.task.cfg
        micro, rows_per_micro = cfg.train.micro_batch_size, cfg.train.micro_batch_size * cfg.grpo.group_size
        restored = self._restored_rows()
        step = self.cycle * self.k
        window = []
        for i in range(cfg.grad_accum):
            prompts = next(self.prompts)
            first = batch_position(task.rank, task.world, cfg.train.global_batch_size, micro, i)
            part = None if restored is None else restored[i * rows_per_micro:(i + 1) * rows_per_micro]
            window.append(task.rollout(prompts, step, first, part))
        return window

    def _restored_rows(self) -> torch.Tensor | None:
        """This rank's share of a checkpoint's generation batch when it is this cycle's (taken once, whatever its
        cycle), else None; a ConfigError when a step resumed inside a cycle needs a batch the checkpoint lacks."""
        restored = self.rollout_state.take_restored()
        saved = None if restored is None else restored[0]
        if problem := restored_cycle_problem(saved, self.cycle, self.offset, self.k):
            raise ConfigError(f"task grpo: {problem}")
        if restored is None or restored[0] != self.cycle:
            return None
        table, rank, world = restored[1], self.task.rank, self.task.world
        share = table.size(0) // world
        return table[rank * share:(rank + 1) * share]


class RolloutCache:
    """The checkpoint object ``grpo_rollouts``: the generation batch of the current cycle when a later step still
    uses it (``iterations`` > 1, a checkpoint inside a cycle), gathered from every rank in global prompt order (so
    a resume on any world size or micro-batch size takes its share); otherwise nothing. ``state_dict`` is a
    collective exactly when a batch is live, which is the same on every rank.

    What a checkpoint holds is checked before it is used, since whoever can write the folder can re-hash its
    manifest: :meth:`restored_problems` (which resume asks before anything loads, finetune.storage.restored.
    check_objects) refuses a table that is not one this recipe writes (rows, columns, dtype, token ids, numbers) or
    a batch that is not of the cycle the resumed step is inside, and :meth:`load_state_dict` refuses the former too;
    each is one line naming ``grpo_rollouts.json``. A forged batch used to fail inside the model at the first resumed
    step (an internal error), after the resume had dropped the metrics rows logged past the checkpoint."""

    optional_in_checkpoint = True
    file = f"{CACHE_NAME}.json"

    def __init__(self, task: GRPOTask, rollout_state: RolloutState) -> None:
        """``task``: the recipe, rewards, model and accelerator the batch is checked and gathered with;
        ``rollout_state``: the task's, holding the live batch and taking a restored one."""
        self.task, self.rollout_state = task, rollout_state

    def state_dict(self) -> dict[str, Any]:
        """``{"cycle": -1}`` when no batch is live, else ``{"cycle": c, "rows": the gathered table}``."""
        live = self.rollout_state.live()
        if live is None:
            return {"cycle": -1}
        cycle, window = live
        table = self.task.cache_rows(window)
        acc = self.task.accelerator
        if acc.num_processes > 1:
            table = acc.gather(table.to(acc.device)).cpu()
        return {"cycle": cycle, "rows": table}

    def load_state_dict(self, state: Any) -> None:
        """Hand a read-back batch to the rollout state once :meth:`problems` finds nothing wrong with it (else one
        line); ``{"cycle": -1}`` holds none."""
        found = self.problems(state)
        if found:
            raise RunDirError(f"{self.file}: {'; '.join(found)}; it was altered or is corrupted: resume from another "
                              "checkpoint (finetune ls lists them)")
        if state["cycle"] >= 0:
            self.rollout_state.restore(state["cycle"], state["rows"])

    def restored_problems(self, held: Any, counters: dict[str, Any]) -> list[str]:
        """What is wrong with what a checkpoint holds for this object (``held``; None: no file, no batch) given its
        checked ``train_state.json`` ``counters``: :meth:`problems`, then whether it is the batch the resumed step
        needs (:func:`restored_cycle_problem`, the rule :class:`Rollouts` applies when training starts). A data
        cursor that is not a whole number of this recipe's steps is a ConfigError (:func:`cycle_at`)."""
        if held is not None and (found := self.problems(held)):
            return found
        cfg = self.task.cfg
        cycle, offset = cycle_at(counters["samples_seen"], cfg.train.global_batch_size, cfg.grpo.iterations)
        saved = held["cycle"] if held is not None and held["cycle"] >= 0 else None
        problem = restored_cycle_problem(saved, cycle, offset, cfg.grpo.iterations)
        return [problem] if problem else []

    def problems(self, state: Any) -> list[str]:
        """What is wrong with a read-back state (empty: nothing). It is ``{"cycle": -1}`` (no batch), or
        ``{"cycle": c >= 0, "rows": table}`` with the table :meth:`GRPOTask.cache_rows` makes, gathered: float64,
        ``train.global_batch_size x grpo.group_size`` rows (every completion of the step's global batch), and as
        columns ``grpo.max_new_tokens`` completion ids (whole numbers in [0, the model's vocabulary)), one reward per
        function (their weighted total finite), then ``max_new_tokens`` old log-probs (``iterations`` > 1) and
        reference log-probs (``beta`` > 0); every number finite."""
        if not isinstance(state, dict) or "cycle" not in state:
            return ["is not the state of a generation batch (no cycle)"]
        cycle = state["cycle"]
        if not isinstance(cycle, int) or isinstance(cycle, bool) or cycle < -1:
            return [f"its cycle is {cycle!r}, not a cycle number (or -1: no batch)"]
        keys = {"cycle"} if cycle < 0 else {"cycle", "rows"}
        if set(state) != keys:
            return [f"holds {', '.join(sorted(map(str, state)))}, not {', '.join(sorted(keys))}"]
        return [] if cycle < 0 else self._table_problems(state["rows"])

    def _table_problems(self, rows: Any) -> list[str]:
        """:meth:`problems` of a batch's table: its shape and dtype first (nothing else can be read without them),
        then its token ids, its numbers and its rewards' weighted totals."""
        cfg, names = self.task.cfg, list(self.task.rewards.names)
        grpo, width = cfg.grpo, cfg.grpo.max_new_tokens
        columns = width * (1 + (grpo.iterations > 1) + (grpo.beta > 0)) + len(names)
        shape = (cfg.train.global_batch_size * grpo.group_size, columns)
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.float64 or tuple(rows.shape) != shape:
            what = (f"a {rows.dtype} tensor of shape {tuple(rows.shape)}" if isinstance(rows, torch.Tensor)
                    else f"a {type(rows).__name__}")
            return [f"its rows are {what}, not the float64 table of shape {shape} that this recipe writes "
                    f"(train.global_batch_size x grpo.group_size rows; grpo.max_new_tokens={width} completion ids, "
                    f"{len(names)} reward(s) and the log-probs grpo.iterations and grpo.beta keep)"]
        found = []
        if not bool(torch.isfinite(rows).all()):
            found.append("it holds numbers that are not finite")
        ids, vocab = rows[:, :width], self.vocabulary()
        wrong = ids[~((ids >= 0) & (ids < vocab) & (ids == ids.floor()))]  # NaN fails every comparison
        if wrong.numel():
            found.append(f"it holds completion token id {float(wrong[0])!r}, not a whole number in [0, {vocab}) "
                         "(the model's vocabulary)")
        if not found:
            try:
                totals = self.task.rewards.total(rows[:, width:width + len(names)].T.tolist())
            except FinetuneError:
                totals = [math.nan]
            if not all(math.isfinite(t) for t in totals):
                found.append("the weighted total of its rewards is not a finite number")
        return found

    def vocabulary(self) -> int:
        """How many token ids the model takes: the smaller of its input and output embedding sizes (a completion id
        beyond them fails inside the model), else its config's ``vocab_size``, else the tokenizer's length."""
        model = self.task.accelerator.unwrap_model(self.task.model)
        sizes = []
        layers = (("get_input_embeddings", "num_embeddings"), ("get_output_embeddings", "out_features"))
        for getter, attribute in layers:
            try:
                size = getattr(getattr(model, getter)(), attribute, None)
            except (AttributeError, NotImplementedError):  # a custom model without one
                continue
            if isinstance(size, int) and size > 0:
                sizes.append(size)
        if sizes:
            return min(sizes)
        return int(getattr(getattr(model, "config", None), "vocab_size", 0) or len(self.task.tokenizer))
