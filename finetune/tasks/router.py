"""The router's auxiliary (load-balancing) loss of a mixture-of-experts model, in the SFT training loss.

transformers' MoE causal LMs (Mixtral, Qwen3-MoE, GPT-OSS, ...) return ``aux_loss`` when their config sets
``output_router_logits`` (the Switch Transformer's balancing loss over the forward's tokens: the number of experts
times the sum over experts of the fraction of tokens routed to it times its mean router probability, padding left
out), and add ``router_aux_loss_coef * aux_loss`` to their loss only when they are given labels. finetune computes
its own chunked loss without labels (:mod:`finetune.tasks.logprobs`), so the SFT task adds the term here.

**The weighting rule.** The aux loss is a statistic of one forward (a micro-batch), not a sum over targets, so
each micro-batch's aux loss is weighted by its number of targets, and the loop's one division by the window's
targets on all ranks turns that into its share of the window::

    loss = (sum over targets of -log p  +  coef * sum over micro-batches m of T_m * aux_m) / T

with ``T_m`` the targets of micro-batch ``m`` (on its rank) and ``T`` the window's (all ranks). Why this rule:

- a window of one micro-batch trains exactly the model's own loss: mean cross-entropy + coef * aux_loss, what
  transformers returns given labels (``tests/unit/test_router.py`` checks it against that);
- the same micro-batches split over accumulation steps and ranks give the same loss and gradient (each term is
  added where it is computed and the sum is divided once): 1 process x accum 2 = 2 processes x accum 1;
- a micro-batch with no targets (all prompt) adds nothing, as to the main loss.

What no weighting can give: the same aux term for another ``train.micro_batch_size``. The model's aux loss of 8 rows
is a product of two means over all 8, not the mean of the aux losses of its rows, so 8x1, 2x4 and 1x8 train the same
cross-entropy (token-weighted, as for any row) and aux terms that differ as the model's own definition makes them
differ, as they would in transformers' Trainer. The logged ``aux_loss`` of a step is the window's
``sum_m T_m * aux_m / T`` (without the coefficient), so the logged ``loss`` is the cross-entropy plus
``coef * aux_loss``; the eval loss is the cross-entropy alone (its perplexity stays one).

Only the SFT tasks (``task: null`` / ``sft``, text and vision) add it. DPO, reward models and GRPO train on their
own objectives: a router's loss per pair or per completion is not defined here, so they train without it and say
so in one line of train.log (:func:`note`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from finetune.errors import ConfigError

SWITCH = "output_router_logits"  # the config key that makes a transformers MoE model return its aux loss
COEFFICIENT = "router_aux_loss_coef"


def routed_config(model: Any) -> Any:
    """The transformers config of a mixture-of-experts ``model`` (through any wrapper: DDP, FSDP, DeepSpeed, peft):
    the first module's own ``config`` that has :data:`SWITCH`; None for a dense model."""
    if not hasattr(model, "modules"):
        return None
    for module in model.modules():
        config = vars(module).get("config")  # the module's own attribute, never a wrapper's forwarding
        if config is not None and hasattr(config, SWITCH):
            return config
    return None


def coefficient(model: Any) -> float:
    """``router_aux_loss_coef`` of a model that returned an aux loss; one line when its config has none."""
    config = routed_config(model)
    value = getattr(config, COEFFICIENT, None)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"the model returns a router aux loss but its config has no number {COEFFICIENT} "
                          f"({value!r}); set model.config_overrides.{COEFFICIENT} (or {SWITCH}: false)")
    return float(value)


@dataclass
class RouterLoss:
    """The router-loss term of a task's training forwards, and the sums behind the step's logged ``aux_loss``.

    ``weighted`` and ``targets`` sum ``T_m * aux_m`` and ``T_m`` over the micro-batches since the last step's
    metrics (detached, on the device: no host sync until the step's one reduce)."""

    weighted: torch.Tensor | None = None
    targets: torch.Tensor | None = None

    def term(self, model: Any, aux_loss: torch.Tensor | None, targets: torch.Tensor) -> torch.Tensor | None:
        """``coef * T_m * aux_m`` to add to a micro-batch's summed loss (None when the forward returned no aux
        loss: a dense model, or ``output_router_logits`` off); remembered for the step's metrics."""
        if aux_loss is None:
            return None
        weighted = aux_loss.float() * targets.to(aux_loss.device, torch.float32)
        self.weighted = weighted.detach() if self.weighted is None else self.weighted + weighted.detach()
        counted = targets.detach().to(aux_loss.device, torch.float32)
        self.targets = counted if self.targets is None else self.targets + counted
        return coefficient(model) * weighted

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """``aux_loss``: the window's target-weighted mean aux loss over all ranks (one reduce, only when the
        model returned one: the same on every rank, whose models share one config); the sums start again."""
        if self.weighted is None or self.targets is None:
            return {}
        sums = reduce(torch.stack([self.weighted.double(), self.targets.double()]))
        self.weighted = self.targets = None
        return {"aux_loss": float(sums[0] / sums[1].clamp(min=1.0))}  # sync


def note(model: Any, adds: bool, task: str) -> str | None:
    """The train.log line about the router loss of a mixture-of-experts ``model`` (None for a dense one): on (its
    coefficient), off (the config's switch, and how to turn it on), or not added by ``task`` (``adds``: whether the
    task adds it)."""
    config = routed_config(model)
    if config is None:
        return None
    if not adds:
        return (f"router load-balancing loss: not added by task {task} (SFT only); the router trains on the task's "
                "loss alone")
    if not getattr(config, SWITCH, False):
        return (f"router load-balancing loss: off (the model's config has {SWITCH}: false); "
                f"model.config_overrides.{SWITCH}=true adds {COEFFICIENT} x aux_loss to the loss")
    return (f"router load-balancing loss: on, {COEFFICIENT}={getattr(config, COEFFICIENT, None)} x aux_loss added "
            "to the training loss (each micro-batch's weighted by its targets; logged as aux_loss)")
