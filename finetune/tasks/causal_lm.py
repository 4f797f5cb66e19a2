"""Causal language modelling: next-token loss on answer tokens; metrics ``token_accuracy`` and ``exact_match``.

``token_accuracy`` is teacher-forced (argmax of each answer position given the true prefix). ``exact_match`` is a
different metric: greedy generation from the prompt alone (finetune.tasks.decoding), compared with the reference
answer after whitespace normalisation. The loss and the accuracy come from the shared target-log-prob mechanism
(finetune.tasks.logprobs). A mixture-of-experts model's router load-balancing loss is added to the training loss,
each micro-batch's weighted by its targets (finetune.tasks.router), and logged per step as ``aux_loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from finetune.data.formats import stop_ids
from finetune.data.rows import IGNORE
from finetune.registry import GENERATING_METRICS
from finetune.tasks import toolcalls
from finetune.tasks.base import EvalCounts, TaskData
from finetune.tasks.decoding import answers, generate_tokens
from finetune.tasks.logprobs import LogProbs, count_next_token_targets, next_token_targets, target_logprobs
from finetune.tasks.router import RouterLoss


def normalize(text: str) -> str:
    """Whitespace-normalised answer text for exact_match."""
    return " ".join(text.split())


def answered(texts: list[str], rows: list[dict[str, Any]]) -> int:
    """How many ``texts`` equal their prompt row's ``answer`` after :func:`normalize` (a row without one: the empty
    answer): exact_match over prompt rows."""
    return sum(normalize(t) == normalize(str(r.get("answer", ""))) for t, r in zip(texts, rows, strict=True))


class CausalLMTask(TaskData):
    """Formats alpaca / chat / completion; the prompt is masked unless ``data.train_on_prompt``.

    The forward gets the batch keys the recipe's row lists in ``model_inputs`` (a custom row's forward may take
    fewer than a Hugging Face model's), plus ``use_cache=False`` for Hugging Face rows only."""

    adds_router_loss = True

    def __init__(self, *args: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids(tokenizer)  # eos, and the chat template's end of turn
        self.router = RouterLoss()

    def _logits(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The full logits of a batch (tests and probes; the loss never builds them: :meth:`_answer`). A padded
        batch has an attention mask; a packed one (data.packing) position ids and no mask (None). Never a KV cache:
        with one, transformers skips the packed-sequence detection and samples attend to each other."""
        out = model(**self.forward.inputs(batch))
        return out.logits if hasattr(out, "logits") else out

    def _answer(self, model: Any, batch: dict[str, Any],
                count_hits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LogProbs]:
        """The summed next-token loss (fp32), the argmax hits (with ``count_hits``) and the number of targets of a
        batch, from the final hidden states and the output head chunk by chunk (:func:`target_logprobs`), and the
        forward's whole result (its router aux loss)."""
        targets = next_token_targets(batch["labels"])
        scores = target_logprobs(model, self.forward.inputs(batch), targets, self.forward.head, per="batch",
                                 count_hits=count_hits)
        return -scores.sums.sum(), scores.hits.sum(), (targets != IGNORE).sum(), scores

    def count_targets(self, batch: dict[str, Any]) -> int:
        """Next-token targets (a packed batch marks each sample's first label IGNORE, so the count is the same)."""
        return count_next_token_targets(batch["labels"])

    def train_output(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The summed next-token loss, plus ``coef * targets * aux_loss`` of a mixture-of-experts model that returns
        one (finetune.tasks.router: the rule and why)."""
        loss_sum, _, num_tokens, scores = self._answer(model, batch)
        router = self.router.term(model, scores.aux_loss, num_tokens)
        return loss_sum if router is None else loss_sum + router

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """``aux_loss`` of a mixture-of-experts model's step (one reduce); nothing, and no collective, otherwise."""
        return self.router.step_metrics(reduce)

    def eval_output(self, model: Any, batch: dict[str, Any]) -> EvalCounts:
        """The eval loss is the cross-entropy alone (the router's aux loss is a training regulariser), so
        ``exp(eval_loss)`` stays a perplexity."""
        loss_sum, hits, num_tokens, _ = self._answer(model, batch, count_hits="token_accuracy" in self.cfg.eval.metrics)
        return self.metric_counts(model, batch, EvalCounts(loss_sum, num_tokens), hits)

    def metric_counts(self, model: Any, batch: dict[str, Any], counts: EvalCounts, hits: torch.Tensor) -> EvalCounts:
        """``counts`` with the eval metrics added: token_accuracy from the argmax ``hits`` over ``counts.num_tokens``,
        and the generating metrics (exact_match, tool_calls) from the model's greedy answers."""
        metrics, num_tokens = self.cfg.eval.metrics, counts.num_tokens
        if "token_accuracy" in metrics:
            counts.correct["token_accuracy"], counts.total["token_accuracy"] = hits, num_tokens
        answers = self._answers(model, batch) if GENERATING_METRICS.intersection(metrics) else []
        if "exact_match" in metrics:
            # each row's last turn is answered: a sample of a chat row's earlier turns has no reference (its
            # prompt is generated from all the same, so every rank of a sharded backend runs the same passes)
            answered = [i for i, reference in enumerate(batch["reference"]) if reference is not None]
            hit = sum(normalize(answers[i]) == normalize(batch["reference"][i]) for i in answered)
            counts.correct["exact_match"] = torch.tensor(hit, device=hits.device)
            counts.total["exact_match"] = torch.tensor(len(answered), device=hits.device)
        if "tool_calls" in metrics:  # rows whose last turn calls tools: the calls, compared as data
            called = [i for i, calls in enumerate(batch.get("calls") or []) if calls is not None]
            hit = sum(toolcalls.correct(answers[i], batch["calls"][i], self.tokenizer) for i in called)
            counts.correct["tool_calls"] = torch.tensor(hit, device=hits.device)
            counts.total["tool_calls"] = torch.tensor(len(called), device=hits.device)
        return counts

    def _generate(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The greedy answer tokens of the batch's prompts (``eval.max_new_tokens`` of them, pad after a stop
        token). Always that many forward passes: the ranks of a sharded backend stay in lockstep."""
        return generate_tokens(model, batch["prompt_ids"], batch["prompt_mask"], self.cfg.eval.max_new_tokens,
                               self.stop_ids, self.pad_id)

    def _answers(self, model: Any, batch: dict[str, Any]) -> list[str]:
        """Each sample's greedy answer to its prompt, cut before its first stop token and decoded without special
        tokens (what exact_match compares, and where tool_calls finds the calls)."""
        return answers(self._generate(model, batch), self.stop_ids, self.tokenizer)
