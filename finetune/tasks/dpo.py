"""Direct preference optimization (``task: dpo``): a causal LM learns from preference pairs, through the same seam.

A micro-batch of B pairs is ONE right-padded batch of 2B sequences (``PreferenceCollator``: chosen rows first,
then rejected), so one forward pass scores both sides of every pair. Per sequence, the policy's log-probability
of its answer is the sum of the next-token log-probs of the answer tokens (labels that are not IGNORE), computed
by the same primitive as the SFT loss (:func:`finetune.tasks.losses.sequence_logprobs`, per sequence) from the final
hidden states and the output head chunk by chunk: no ``[tokens x vocab]`` logits, no host sync.

With ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (policy minus reference log-ratio of chosen over rejected), the loss of
a pair is

* ``sigmoid`` (default): ``-(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)`` over SUMMED answer log-probs
  (``ls`` = ``dpo.label_smoothing``, conservative DPO; 0 is plain DPO);
* ``ipo``: ``(h - 1 / (2 beta))^2`` over per-token AVERAGED answer log-probs (each sequence's sum divided by its
  answer tokens), as in the IPO paper; the reference is averaged the same way, and so are the reward margin and
  the preference accuracy of an ipo run.

A target is a pair: ``count_targets`` is the number of pairs and ``train_output`` the SUM of the per-pair losses, so
the loop's one division makes the step loss the mean over every pair of the window on all ranks (pair-weighted
accumulation: 8x1, 2x4 and 1x8 micro-batches give the same step).

The reference is the initial model: :func:`compute_reference` runs ONCE before training (before a resume loads its
checkpoint, so a resumed run uses the same numbers) and stores each pair's reference log-probs as the ``ref_logps``
column of the tokenized data, which the collator hands to the task. For LoRA the reference is the same model with
its adapter disabled, so no second model is ever held in memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from finetune.data.batching import PreferenceCollator
from finetune.data.rows import IGNORE
from finetune.tasks.base import EvalCounts, PairTask
from finetune.tasks.logprobs import FORWARD, Forward, next_token_targets, target_logprobs
from finetune.tasks.losses import sequence_logprobs

PROGRESS_EVERY_S = 30.0  # a reference pass that runs longer reports its progress this often


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """``[S]`` fp32: for each of the ``S`` sequences of ``logits`` ``[S, T, V]`` (logits a caller already holds),
    the sum over positions whose ``targets`` ``[S, T]`` is not IGNORE of ``log_softmax(logits)[target]``, with grad;
    :func:`finetune.tasks.losses.sequence_logprobs` over the logits, one chunk of ``chunk_rows`` rows at a time.
    ``targets`` are next-token targets (:func:`finetune.tasks.logprobs.next_token_targets`)."""
    if logits.dim() != 3 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"expected logits [S, T, V] and targets [S, T], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    sequences, length, vocab = logits.shape
    seq = torch.arange(sequences, device=logits.device)[:, None].expand(sequences, length).reshape(-1)
    return sequence_logprobs(logits.reshape(-1, vocab), targets.reshape(-1), seq, sequences, chunk_rows=chunk_rows)[0]


def policy_logps(model: Any, batch: dict[str, Any], forward: Forward = FORWARD) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's summed answer log-prob of every sequence of a preference batch (``[2B]`` fp32) and the number
    of answer tokens of each, from the final hidden states and the row's output head (``forward``) chunk by chunk (no
    ``[tokens x vocab]`` logits, no host sync: :func:`finetune.tasks.logprobs.target_logprobs`). Never a KV cache
    (training forwards; see CausalLMTask)."""
    targets = next_token_targets(batch["labels"])
    logps = target_logprobs(model, forward.inputs(batch), targets, forward.head, per="sequence").sums
    return logps, (targets != IGNORE).sum(1)


def pair_losses(h: torch.Tensor, beta: float, label_smoothing: float = 0.0, kind: str = "sigmoid") -> torch.Tensor:
    """The loss of each pair from its log-ratio difference ``h`` (see the module docstring)."""
    h = h.float()
    if kind == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    if kind != "sigmoid":
        raise ValueError(f"unknown dpo loss {kind!r}")
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


class DPOTask(PairTask):
    """Preference pairs against reference log-probs; metrics ``preference_accuracy`` and the means
    ``reward_margin``, ``logps_chosen``, ``logps_rejected`` (per pair)."""

    eval_means = ("reward_margin", "logps_chosen", "logps_rejected")

    def _pairs(self, model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per pair: the loss and ``h``; and the policy's summed log-probs of the 2B sequences."""
        if "ref_logps" not in batch:
            raise RuntimeError("task dpo: the batch has no ref_logps; compute_reference() must run before training "
                               "and evaluation")
        logps, tokens = policy_logps(model, batch, self.forward)
        policy, reference = logps, batch["ref_logps"].to(logps.device, torch.float32)
        dpo = self.cfg.dpo
        if dpo.loss == "ipo":  # per-token averages (IPO), the reference likewise
            length = tokens.clamp(min=1).to(torch.float32)
            policy, reference = policy / length, reference / length
        pairs = int(batch["pairs"])
        ratios = policy - reference
        h = ratios[:pairs] - ratios[pairs:]
        return pair_losses(h, dpo.beta, dpo.label_smoothing, dpo.loss), h, logps

    def prepare(self, initial: Callable[[], Any], accelerator: Any, precision: Any, log: Callable[[str], None],
                splits: tuple[str, ...] = ("train", "eval")) -> None:
        """Score the reference log-probs of ``splits`` with the initial model (:func:`compute_reference`)."""
        compute_reference(self, initial(), accelerator, precision, log, splits)

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The sum of the per-pair losses (the loop divides by the pairs of the window)."""
        return self._pairs(model, batch)[0].sum()

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts:
        losses, h, logps = self._pairs(model, batch)
        pairs = int(batch["pairs"])
        n = torch.tensor(pairs, device=losses.device)
        counts = EvalCounts(losses.sum(), n)
        if "preference_accuracy" in self.cfg.eval.metrics:
            # correct: the chosen answer's implicit reward beta * (pi - ref) beats the rejected one's (ties lose)
            counts.correct["preference_accuracy"], counts.total["preference_accuracy"] = (h > 0).sum(), n
        counts.means["reward_margin"] = ((self.cfg.dpo.beta * h).sum(), n)
        counts.means["logps_chosen"] = (logps[:pairs].sum(), n)
        counts.means["logps_rejected"] = (logps[pairs:].sum(), n)
        return counts


# ------------------------------------------------------------------------------------------ the reference pass


def reference_schedule(size: int, batch_pairs: int, rank: int, world: int) -> list[tuple[int, int] | None]:
    """The reference batches this rank runs, in order: ``(start, end)`` pair ranges, or None for a filler.

    The pairs are cut into fixed batches by global index (batch ``j`` is ``[j*batch_pairs, (j+1)*batch_pairs)``),
    whatever the number of processes, so every value is computed on exactly the same batch (same padding, same
    shapes) on 1 or N processes. Rank ``r`` takes batches ``r, r+world, ...``; every rank runs the same number of
    forward passes (fillers repeat a batch and are discarded), which sharded backends need."""
    batches = math.ceil(size / batch_pairs)
    per_rank = math.ceil(batches / world)
    out: list[tuple[int, int] | None] = []
    for k in range(per_rank):
        j = k * world + rank
        out.append((j * batch_pairs, min((j + 1) * batch_pairs, size)) if j < batches else None)
    return out


def unstride(gathered: torch.Tensor, size: int, world: int) -> torch.Tensor:
    """``[size, 2]`` in pair order from the gathered per-rank results ``[world * per_rank, batch_pairs, 2]``
    (rank-major, as an all-gather concatenates them): rank r's k-th batch is global batch ``k * world + r``."""
    per_rank, batch_pairs = gathered.size(0) // world, gathered.size(1)
    ordered = gathered.reshape(world, per_rank, batch_pairs, 2).transpose(0, 1)
    return ordered.reshape(-1, 2)[:size]


def reference_values(dataset: Any, score: Callable[[dict[str, Any]], torch.Tensor], collate: PreferenceCollator,
                     batch_pairs: int, rank: int, world: int, device: torch.device,
                     progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """This rank's part of a reference pass over ``dataset``: ``[per_rank, batch_pairs, 2]`` (chosen, rejected
    summed log-probs; zeros past the end), to be all-gathered and put in order with :func:`unstride`.
    ``score`` maps a collated batch (on ``device``) to its ``[2B]`` log-probs."""
    rows = dataset.with_format(None)
    schedule = reference_schedule(len(rows), batch_pairs, rank, world)
    out = torch.zeros((len(schedule), batch_pairs, 2), dtype=torch.float32, device=device)
    for k, span in enumerate(schedule):
        start, end = span if span is not None else (0, min(batch_pairs, len(rows)))
        columns = rows[start:end]
        batch = collate([dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)])
        batch = {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in batch.items()}
        logps = score(batch).detach().to(torch.float32)
        if span is not None:
            pairs = end - start
            out[k, :pairs, 0], out[k, :pairs, 1] = logps[:pairs], logps[pairs:]
            if progress is not None:
                progress(pairs * world)
    return out


def compute_reference(task: DPOTask, model: Any, accelerator: Any, precision: Any, log: Callable[[str], None],
                      splits: tuple[str, ...] = ("train", "eval")) -> None:
    """Score every pair of ``splits`` with the model as it is now (the initial model; for LoRA the base, with the
    adapter disabled) and store the results as each split's ``ref_logps`` column.

    Every rank runs the same forward passes over fixed batches of ``eval.batch_size`` pairs (see
    :func:`reference_schedule`) and the results are all-gathered, so the values do not depend on the number of
    processes or the backend. Eval mode (no dropout), the recipe's autocast, no gradients."""
    unwrapped = accelerator.unwrap_model(model)
    adapter_off = unwrapped.disable_adapter() if hasattr(unwrapped, "disable_adapter") else nullcontext()
    parts = [(name, split) for name in splits if (split := getattr(task.data, name)) is not None]
    total = sum(len(split.dataset) for _, split in parts)
    log(f"reference log-probs: scoring {total} pairs ({', '.join(f'{len(s.dataset)} {n}' for n, s in parts)}) with "
        f"the initial model{' (adapter disabled)' if hasattr(unwrapped, 'disable_adapter') else ''} ...")
    started = time.monotonic()
    state = {"done": 0, "next": started + PROGRESS_EVERY_S}

    def progress(pairs: int) -> None:
        state["done"] += pairs
        if time.monotonic() >= state["next"]:
            state["next"] = time.monotonic() + PROGRESS_EVERY_S
            log(f"reference log-probs: {min(state['done'], total)}/{total} pairs")

    def score(batch: dict[str, Any]) -> torch.Tensor:
        with precision.autocast():
            return policy_logps(model, batch, task.forward)[0]

    was_training = model.training
    model.eval()
    results = []
    try:
        with adapter_off, torch.no_grad():
            for _, split in parts:
                mine = reference_values(split.dataset, score, task.eval_collator(), task.cfg.eval.batch_size,
                                        accelerator.process_index, accelerator.num_processes,
                                        accelerator.device, progress)
                gathered = accelerator.gather(mine) if accelerator.num_processes > 1 else mine
                results.append(unstride(gathered.cpu(), len(split.dataset), accelerator.num_processes))
    finally:
        model.train(was_training)
    from datasets import Sequence, Value  # lazy: heavy

    with accelerator.main_process_first():  # adding a column may write a cache file: rank 0 first
        for (_, split), values in zip(parts, results, strict=True):
            dataset = split.dataset.remove_columns("ref_logps") if "ref_logps" in split.dataset.column_names \
                else split.dataset
            split.dataset = dataset.add_column("ref_logps", values.tolist(), feature=Sequence(Value("float32")))
    every = torch.cat(results) if results else torch.zeros((0, 2))
    log(f"reference log-probs: {total} pairs in {time.monotonic() - started:.1f}s; mean summed log-prob chosen "
        f"{every[:, 0].double().mean().item():.4f}, rejected {every[:, 1].double().mean().item():.4f}")
