"""Detect a collapsed run: the model stopped responding to training, though every number stays finite.

A learning rate far too high can drive a model into a dead state instead of inf or nan: its output no longer depends
on its input (every logit equal, every reward score equal), so the loss sits at the value of a uniform prediction
(``ln(vocab size)`` for a causal LM, ``ln(labels)`` for a classifier, ``ln 2`` for a reward model) and the
gradient is exactly zero, step after step. Nothing can be learned from there, yet such a run used to finish, export
its dead model and exit 0.

The rule (:meth:`Signature.matches`), on the loss and the gradient norm the loop already reduces over all ranks (so
every rank decides the same): a step *looks collapsed* when it made an update, its gradient norm is at most
:data:`ZERO_GRAD_NORM`, and its loss is the task's uniform-prediction loss within :data:`UNIFORM_TOLERANCE`
(relative); for a task whose dead loss is not known (DPO: it depends on the reference; a custom model without a
known output width), its loss is at least :data:`LOSS_FLOOR`. The run stops after :data:`STEPS` such steps in a row,
or at once when it ends at such a step (the last step, whose weights would be the export, or a stop signal, whose
checkpoint would be resumed); no checkpoint is saved of a step that looks collapsed.

Why it does not fire on a healthy run: a zero gradient alone is not a collapse. A model that predicts its targets
perfectly has a ~0 gradient too, but a ~0 loss (neither the uniform loss nor above the floor); a step skipped for an
fp16 overflow or a non-finite value has an infinite or nan gradient norm and made no update; LoRA's zero-initialised
``B`` still gets a gradient, and frozen parameters have none at all (they do not count in the norm). GRPO is never
checked: a group whose completions all got the same reward has advantage 0, a legitimately zero gradient at any
loss. A freshly initialised model's loss is near the uniform value, but its gradient is far from zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import objectives, registry

STEPS = 3
"""Collapsed steps in a row that stop a run. One is already conclusive (an exact zero gradient at exactly the
uniform loss); three, like ``train.max_nonfinite_steps``' default, ride out a single odd step and cost nothing (a
collapsed model trains no further). Not ``train.max_nonfinite_steps`` itself: raising that to ride out fp16 overflows
must not delay this stop."""

ZERO_GRAD_NORM = 1e-12
"""A gradient norm at most this is zero (a dead model's is exactly 0.0; this admits rounding dust). A live model
whose loss is not ~0 has a gradient norm many orders of magnitude larger."""

UNIFORM_TOLERANCE = 1e-4
"""How close (relative) a collapsed step's loss is to the uniform-prediction loss: equal logits give it to float32
rounding (~1e-7); a freshly initialised tiny model's loss, which is near it but not dead, is ~3e-4 away or more."""

LOSS_FLOOR = 1e-3
"""Where the uniform loss is unknown, a zero gradient at a loss below this is a model that predicts its targets
(nearly) perfectly, not a collapsed one (its gradient underflows only once its loss is far below this)."""


@dataclass(frozen=True)
class Signature:
    """What a collapsed step of this run looks like: a zero gradient, and a loss at :attr:`uniform` (an output that
    ignores its input gives each of ``outcomes`` the same probability; ``meaning`` says what that is for the task)
    or, when ``outcomes`` is unknown (None), at least :data:`LOSS_FLOOR`."""

    outcomes: int | None = None
    meaning: str = ""  # e.g. "a uniform prediction over the 512-token vocabulary (every logit equal)"

    @property
    def uniform(self) -> float | None:
        """The uniform-prediction loss ``ln(outcomes)``; None when unknown."""
        return math.log(self.outcomes) if self.outcomes is not None else None

    def matches(self, loss: float, grad_norm: float) -> bool:
        """Whether a step with this (all-reduced) loss and gradient norm looks collapsed."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm) and 0.0 <= grad_norm <= ZERO_GRAD_NORM):
            return False
        uniform = self.uniform
        if uniform is None:
            return loss >= LOSS_FLOOR
        return abs(loss - uniform) <= UNIFORM_TOLERANCE * uniform

    def describe(self, loss: float, *, meaning: bool = True) -> str:
        """How the loss of a collapsed step is worded: its value, and (``meaning``) what that value means."""
        if self.outcomes is None:
            return f"the loss stayed at {loss:.4g}"
        value = f"the loss sat at ln({self.outcomes}) = {math.log(self.outcomes):.4f}"
        return f"{value}, the loss of {self.meaning}" if meaning else value


def _output_width(model: Any) -> int | None:
    """The number of logits a causal LM predicts per token: its output head's width (the vocabulary the loss runs
    over, padding rows included), else its text config's ``vocab_size``; None when neither is known (a custom
    model)."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    width = getattr(head, "out_features", None)
    if isinstance(width, int):
        return width
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    vocab = getattr(text, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def signature(objective: str | None, row_task: str | None, model: Any) -> Signature | None:
    """The collapse signature of a run of ``objective`` (the recipe's ``task``) on a row of ``row_task``, read from
    the plain (unwrapped) ``model``; None: never checked (GRPO, see the module docstring). The objective's record
    says which signature (its ``collapse``), else the row task's record (a score pair, labels, or the vocabulary)."""
    record = objectives.objective(objective)
    kind = record.collapse if record is not None else "row"
    if kind == "never":
        return None
    if kind == "unknown":  # DPO: a dead policy's loss depends on the reference log-probs, not a known constant
        return Signature()
    rules = registry.ROW_TASKS.get(row_task) if isinstance(row_task, str) else None  # type: ignore[call-overload]
    if kind == "pairs" or (rules is not None and rules.scores):
        return Signature(2, "equal scores for the chosen and the rejected answer")
    if rules is not None and rules.labels:
        labels = getattr(getattr(model, "config", None), "num_labels", None)
        return Signature(labels, f"a uniform prediction over the {labels} labels") \
            if isinstance(labels, int) and labels > 1 else Signature()
    width = _output_width(model)
    return Signature(width, f"a uniform prediction over the {width}-token vocabulary (every logit equal)") \
        if width is not None and width > 1 else Signature()


@dataclass
class Watch:
    """The collapsed steps in a row of a run so far (:meth:`observe` once per optimizer step, on every rank)."""

    signature: Signature | None
    streak: int = 0

    def observe(self, loss: float, grad_norm: float, skipped: bool) -> bool:
        """Count a step; True when it looks collapsed. A step that made no update (fp16 overflow, non-finite)
        breaks the streak: its gradient was not zero."""
        dead = self.signature is not None and not skipped and self.signature.matches(loss, grad_norm)
        self.streak = self.streak + 1 if dead else 0
        return dead

    def must_stop(self, ending: bool) -> bool:
        """After :data:`STEPS` collapsed steps in a row, or at once when the run ends at a step that looks collapsed
        (``ending``: its weights would be the export, or the checkpoint a stop signal saves)."""
        return self.streak >= STEPS or (ending and self.streak > 0)

    def step_line(self, step: int, loss: float) -> str:
        """The train.log line of a collapsed step."""
        assert self.signature is not None
        return (f"step {step}: gradient norm 0 and {self.signature.describe(loss, meaning=False)}: the model looks "
                f"collapsed ({self.streak} in a row; the run stops at {STEPS})")

    def stop_line(self, step: int, loss: float, lr: float, run_dir: Path, kept: str | None) -> str:
        """The one line a collapsed run stops with: what collapsed, the likely cause, what is kept and how to go
        on. ``kept``: the newest resumable checkpoint's name (saved before these steps: none is saved during them)."""
        assert self.signature is not None
        then = (f", or continue {kept} (the newest checkpoint, from before these steps, if its loss was still sane) "
                f"with `finetune resume {run_dir} --from {kept} optim.lr=... --allow-config-change`" if kept
                else " (no checkpoint was saved before these steps)")
        steps = f"{self.streak} steps in a row" if self.streak > 1 else "1 step"
        return (f"training collapsed: for {steps} up to step {step} the gradient norm was 0 "
                f"and {self.signature.describe(loss)}: the model no longer responds to its input; nothing was "
                f"exported. Likely cause: a learning rate far too high (optim.lr {lr:g}); start again with a lower "
                f"optim.lr{then}")
