"""Distillation (``task: distill``): the student (the recipe's model) learns a frozen teacher's next-token
distributions through the same seam as SFT.

Per target token (a next-token target that is not IGNORE: an answer token, as SFT's), with the teacher's and the
student's logits at that position, the loss is ``(1 - alpha) x D(teacher, student) + alpha x CE(student, target)``,
``D`` the ``distill.loss`` divergence at ``distill.temperature`` (optionally over the teacher's ``top_k``;
:mod:`finetune.tasks.divergence`), computed chunk by chunk from both models' final hidden states
(:mod:`finetune.tasks.chunked_divergence`: no ``[tokens x vocab]`` logits for either). ``train_output`` returns the
sum and ``count_targets`` the target tokens, so the loop's one division makes the step's loss the mean over every
target token of the window on all ranks (8x1 = 2x4 = 1x8).

Modes (``distill.mode``):

* ``offline``: the targets are the data's own answer tokens (alpaca, chat or completion rows, as SFT reads them).
* ``on_policy`` also reads prompt rows (``data.format: prompt``, GRPO's: no answers), sampled at every step
  (``distill.lmbda`` 1); their eval is the student's greedy completions: exact_match against each row's ``answer``
  and the divergence to the teacher on those completions (no eval loss: there are no answers to score).
* ``on_policy``: at each step chosen (``distill.lmbda``: every step at 1, else a fraction of them drawn from
  ``(train.seed, step)``, the same on every rank), each row's answer is replaced by a completion the student samples
  from the row's prompt with its current weights (eval mode, the recipe's autocast, at ``distill.temperature``, up to
  ``distill.max_new_tokens`` tokens and the first stop token), and the targets are that completion's tokens: the
  rows' answers are never a target of such a step. Each completion is drawn from its own generator, seeded by
  ``(train.seed, step, the row's position in the step's global batch)`` (GRPO's :func:`completion_seed`), so it does
  not depend on the micro-batch size or the number of processes; a resumed run draws the same ones.

The teacher (``distill.teacher``) is built once, frozen, in the student's dtype, and placed by the backend beside the
student: whole on one process, DDP, ZeRO-1/2 and FSDP1, sharded as the student on FSDP2 and ZeRO-3
(:meth:`finetune.backends.Backend.frozen_module`). Under LoRA, a teacher that is the student's own ``model.path`` is
the student with its adapter disabled (self-distillation; eval mode), never a second copy. Its forward runs on every
micro-batch and eval batch, in the recipe's autocast, without gradients, on every rank (sharded ranks stay in
lockstep). It is never saved.

Metrics: the train row's ``divergence`` (mean per target token) and, on on-policy steps, ``completion_len`` (mean
tokens per completion) and ``teacher_logprob`` (the teacher's mean log-prob per completion token); the eval row's
``eval_loss`` (the student's cross-entropy on the eval answers, so ``eval_ppl`` is its perplexity),
``eval_divergence`` and ``eval_teacher_loss`` (the teacher's cross-entropy there), and the row task's metrics.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from finetune.data import prompt_rows
from finetune.data.batching import Collator
from finetune.data.rows import IGNORE
from finetune.tasks.base import EvalCounts
from finetune.tasks.causal_lm import CausalLMTask, answered
from finetune.tasks.chunked_divergence import Rule, Side, distill_sums
from finetune.tasks.decoding import answers
from finetune.tasks.grpo import PolicyGenerator, batch_position, completion_mask, completion_seed
from finetune.tasks.logprobs import Forward, find_head, next_token_targets, through_head

# the train row's sums of one step, in the order one all-reduce carries them
WINDOW = ("divergence", "tokens", "teacher_nll", "completions", "completion_tokens", "on_policy")


def on_policy_step(seed: int, step: int, fraction: float) -> bool:
    """Whether step ``step`` trains on the student's own completions: always at ``fraction`` 1, never at 0, else
    when a uniform number drawn from ``(seed, step)`` alone is below it (the same answer on every rank and resume)."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(f"distill:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < fraction


class DistillTask(CausalLMTask):
    """SFT's rows and metrics, a teacher's distributions as the targets (see the module docstring)."""

    adds_router_loss = False  # the divergence alone; a mixture-of-experts student's router loss is not added

    def __init__(self, *args: Any, tokenizer: Any, teacher: Callable[..., Any] | None = None, **kwargs: Any) -> None:
        """``teacher``: the factory of the placed teacher (``factory(model, accelerator)`` ->
        :class:`finetune.runtime.teacher.TeacherModel`), called in :meth:`prepare`; None (``finetune eval`` of a
        distilled run): the student is evaluated as SFT's is, without the teacher's metrics."""
        super().__init__(*args, tokenizer=tokenizer, **kwargs)
        self.settings = self.cfg.distill
        self.rule = Rule.of(self.settings)
        self.make_teacher, self.teacher, self.teacher_forward = teacher, None, Forward()
        self.teacher_sharded, self.teacher_context = False, contextlib.nullcontext
        self.prompt_rows = self.cfg.data.format == prompt_rows.FORMAT  # no answers: on-policy only, no eval loss
        self.eval_loss = self.perplexity = not self.prompt_rows
        means = ("divergence",) if self.prompt_rows else ("divergence", "teacher_loss")
        self.eval_means = means if teacher is not None else ()
        self.window: torch.Tensor | None = None  # the step's WINDOW sums, on the model's device (no host sync)
        self.model: Any = None
        self.precision: Any = None

    @property
    def on_policy(self) -> bool:
        return self.settings.mode == "on_policy"

    def prepare(self, initial: Callable[[], Any], accelerator: Any, precision: Any, log: Callable[[str], None],
                splits: tuple[str, ...] = ("train", "eval")) -> None:
        """Build and place the teacher beside the prepared student (the model on-policy steps sample from); without
        a teacher (``finetune eval``), nothing: the initial model is not asked for."""
        if self.make_teacher is None:
            return
        self.model, self.precision = initial(), precision
        built = self.make_teacher(self.model, accelerator)
        self.teacher, self.teacher_forward = built.module, Forward.of(built.row)
        self.teacher_sharded, self.teacher_context = built.sharded, built.context
        placed = "the student's base with its adapter disabled" if built.adapter_off else \
            "sharded as the student" if built.sharded else "whole on each process"
        log(f"distill: teacher {self.settings.teacher} ({built.row.name}; {placed}), {self.settings.mode}, "
            f"{self.settings.loss} at temperature {self.settings.temperature:g}"
            + (f", top {self.settings.top_k}" if self.settings.top_k else "")
            + (f", alpha {self.settings.alpha:g}" if self.settings.alpha else "")
            + (f", on-policy fraction {self.settings.lmbda:g}" if self.on_policy else ""))

    # ---------------------------------------------------------------------------------------------- the data

    def train_collator(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """On-policy rows carry their prompts (left-padded) to sample from (prompt rows are nothing else); offline
        ones are SFT's."""
        if self.prompt_rows:
            return prompt_rows.PromptCollator(self.pad_id)
        return Collator(self.pad_id, with_prompts=True) if self.on_policy else super().train_collator()

    def eval_collator(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """Prompt rows are evaluated from their prompts (left-padded); other rows as SFT's."""
        return prompt_rows.PromptCollator(self.pad_id) if self.prompt_rows else super().eval_collator()

    def count_samples(self, batch: dict[str, Any]) -> int:
        """One sample per row (a prompt-row batch holds its prompts only)."""
        return len(batch["prompt_ids"] if self.prompt_rows else batch["input_ids"])

    def build_dataloader(self, split: str, start_sample: int = 0) -> Iterable[dict[str, Any]]:
        batches = super().build_dataloader(split, start_sample)
        if split != "train" or not self.on_policy:
            return batches
        return _OnPolicy(self, batches, start_sample // self.cfg.train.global_batch_size)

    def sampled_batch(self, batch: dict[str, Any], step: int, micro: int) -> dict[str, Any]:
        """The micro-batch ``micro`` of step ``step`` as it trains: its rows' answers replaced by the student's
        completions of their prompts on an on-policy step, else as the data has it."""
        cfg = self.cfg
        if not on_policy_step(cfg.train.seed, step, self.settings.lmbda):
            return {key: value for key, value in batch.items() if key in ("input_ids", "attention_mask", "labels")}
        prompts, mask = batch["prompt_ids"], batch["prompt_mask"]
        first = batch_position(self.rank, self.world, cfg.train.global_batch_size, cfg.train.micro_batch_size, micro)
        seeds = [completion_seed(cfg.train.seed, step, first + i, 0) for i in range(prompts.size(0))]
        generator = PolicyGenerator(self.model, self.precision, max_new_tokens=self.settings.max_new_tokens,
                                    temperature=self.settings.temperature, top_p=1.0, stop_ids=self.stop_ids,
                                    pad_id=self.pad_id, lockstep=self.lockstep)
        device = next(iter(self.model.parameters())).device
        return self.completed(prompts, mask, generator.complete(prompts.to(device), mask.to(device), seeds).cpu())

    def completed(self, prompts: torch.Tensor, mask: torch.Tensor, completions: torch.Tensor) -> dict[str, Any]:
        """The host batch of each prompt (left-padded ``prompts`` / ``mask``; its end kept within
        ``data.max_seq_len - distill.max_new_tokens``) followed by its completion up to and including the first stop
        token, right-padded; the completion tokens are the targets. Also the completions' count and tokens."""
        kept = completion_mask(completions, self.stop_ids).bool()
        room = self.cfg.data.max_seq_len - self.settings.max_new_tokens
        rows = []
        for ids, real, tokens, keep in zip(prompts, mask.bool(), completions, kept, strict=True):
            prompt, completion = ids[real].tolist()[-room:], tokens[keep].tolist()
            rows.append({"input_ids": prompt + completion, "labels": [IGNORE] * len(prompt) + completion})
        out = Collator(self.pad_id)(rows)
        out["completions"], out["completion_tokens"] = len(rows), int(kept.sum())
        return out

    # ---------------------------------------------------------------------------------------------- the loss

    def teacher_side(self, batch: dict[str, Any]) -> Side:
        """The teacher's final hidden states of the batch and its head (a sharded teacher's gathered head weight
        copied out of its forward, which releases it), without gradients."""
        assert self.teacher is not None
        spec = self.teacher_forward.head
        head = find_head(self.teacher, spec.name if spec is not None else None)
        inputs = self.teacher_forward.inputs(batch)
        with torch.no_grad(), self.teacher_context():
            if head is None:  # a teacher whose head is not named: its logits, whole
                out = self.teacher(**inputs)
                logits = out.logits if hasattr(out, "logits") else out
                return Side(logits.reshape(-1, logits.size(-1)))
            held: dict[str, Side] = {}

            def capture(flat: torch.Tensor, call: Any) -> torch.Tensor:
                if call.weight is None:  # a head module that is not a plain Linear: its logits, whole
                    held["side"] = Side(call.module(flat), divisor=call.divisor, softcap=call.softcap)
                else:
                    copy = self.teacher_sharded
                    held["side"] = Side(flat, call.weight.detach().clone() if copy else call.weight.detach(),
                                        None if call.bias is None else call.bias.detach().clone(),
                                        call.divisor, call.softcap)
                return flat.new_zeros(1)

            through_head(self.teacher, inputs, head, batch["input_ids"].shape, capture, spec)
        return held["side"]

    def _sums(self, model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's loss sum (with grad), its :data:`finetune.tasks.chunked_divergence.STATS` sums and its
        target tokens: the teacher's forward, then the student's with the loss in place of its head."""
        targets = next_token_targets(batch["labels"])
        side = self.teacher_side(batch)
        flat_targets = targets.reshape(-1)
        spec = self.forward.head
        head = find_head(model, spec.name if spec is not None else None)
        if head is None:  # a student whose head is not named: its logits (built whole)
            out = model(**self.forward.inputs(batch))
            logits = out.logits if hasattr(out, "logits") else out
            loss, stats = distill_sums(logits.reshape(-1, logits.size(-1)), flat_targets, side, self.rule)
            return loss, stats, (targets != IGNORE).sum()
        held: dict[str, torch.Tensor] = {}

        def compute(flat: torch.Tensor, call: Any) -> torch.Tensor:
            loss, held["stats"] = distill_sums(flat, flat_targets, side, self.rule, weight=call.weight,
                                               bias=call.bias, head=call.module, divisor=call.divisor,
                                               softcap=call.softcap)
            return loss.reshape(1)

        _, loss = through_head(model, self.forward.inputs(batch), head, targets.shape, compute, spec)
        return loss.sum(), held["stats"], (targets != IGNORE).sum()

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The summed loss of the micro-batch's target tokens; its divergence and teacher sums kept for the row."""
        loss, stats, tokens = self._sums(model, batch)
        completions = float(batch.get("completions", 0))
        counts = torch.tensor([completions, float(batch.get("completion_tokens", 0)), float(completions > 0)],
                              dtype=torch.float64, device=stats.device)
        part = torch.cat([stats[0:1], tokens.reshape(1).double(), stats[2:3], counts])
        self.window = part if self.window is None else self.window + part
        return loss

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The step's ``divergence`` per target token and, on an on-policy step, ``completion_len`` and
        ``teacher_logprob`` (one reduce of the window's sums, on every rank)."""
        window = self.window if self.window is not None else torch.zeros(len(WINDOW), dtype=torch.float64)
        summed = dict(zip(WINDOW, reduce(window).tolist(), strict=True))
        self.window = None
        tokens = max(summed["tokens"], 1.0)
        row = {"divergence": summed["divergence"] / tokens}
        if summed["on_policy"]:
            row["completion_len"] = summed["completion_tokens"] / max(summed["completions"], 1.0)
            row["teacher_logprob"] = -summed["teacher_nll"] / tokens
        return row

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts:
        """The student's cross-entropy (the eval loss), the divergence and the teacher's cross-entropy, from one
        pass of each model; then the row task's metrics. Without a teacher: SFT's eval. Prompt rows:
        :meth:`_prompt_eval`."""
        if self.prompt_rows:
            return self._prompt_eval(model, batch)
        if self.teacher is None:
            return super().eval_output(model, batch)
        _, stats, tokens = self._sums(model, batch)
        counts = EvalCounts(stats[1], tokens)
        counts.means["divergence"] = (stats[0], tokens)
        counts.means["teacher_loss"] = (stats[2], tokens)
        return self.metric_counts(model, batch, counts, stats[3].long())

    def _prompt_eval(self, model: Any, batch: dict[str, Any]) -> EvalCounts:
        """Prompt rows (no answers, no loss): the student's greedy completions (``eval.max_new_tokens``, lockstep),
        exact_match against each row's ``answer``, and the divergence to the teacher on those completions' tokens."""
        new = self._generate(model, batch)
        texts = answers(new, self.stop_ids, self.tokenizer)
        device = new.device
        counts = EvalCounts(torch.zeros((), device=device), torch.tensor(float(len(texts)), device=device))
        if "exact_match" in self.cfg.eval.metrics:
            counts.correct["exact_match"] = torch.tensor(float(answered(texts, batch["rows"])), device=device)
            counts.total["exact_match"] = torch.tensor(float(len(texts)), device=device)
        if self.teacher is not None:
            done = self.completed(batch["prompt_ids"].cpu(), batch["prompt_mask"].cpu(), new.cpu())
            _, stats, tokens = self._sums(model, {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                                  for k, v in done.items()})
            counts.means["divergence"] = (stats[0], tokens)
        return counts


class _OnPolicy:
    """The train dataloader of an on-policy run: the data's micro-batches, each as :meth:`DistillTask.sampled_batch`
    makes it at its step (``start_step``: the step the loop's cursor starts at)."""

    def __init__(self, task: DistillTask, batches: Iterable[dict[str, Any]], start_step: int) -> None:
        self.task, self.batches, self.start_step = task, batches, start_step

    def __iter__(self) -> Iterator[dict[str, Any]]:
        accum = self.task.cfg.grad_accum
        for i, batch in enumerate(self.batches):
            yield self.task.sampled_batch(batch, self.start_step + i // accum, i % accum)
