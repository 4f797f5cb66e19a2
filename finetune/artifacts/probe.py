"""The logit probe: a few fixed inputs and the live model's logits on them, recorded in every checkpoint.

Why: a checkpoint is exported (``finetune export``, ``finetune eval`` of a checkpoint) by reading its weights in
whatever layout the backend wrote and loading them into a freshly built model. Comparing that model's logits with
the ones the training process itself computed at the same step proves the conversion, the save and the reload
end to end, for every backend, instead of trusting them.

:class:`LogitProbe` is one of the worker's checkpointed ``objects``: at a checkpoint every rank calls its
``state_dict()`` (a forward pass is a collective under sharded backends) and rank 0 writes the result as
``probe.json`` + ``probe.safetensors`` through :func:`finetune.storage.checkpoints.write_state`. Resuming loads nothing
from it. :func:`read` gets it back (``None`` for checkpoints written before probes existed). """

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError, RunDirError
from finetune.storage import restored
from finetune.storage.checkpoints import read_state

NAME = "probe"  # the checkpoint object's name: probe.json (+ probe.safetensors), see checkpoints.write_state
KEYS = ("input_ids", "attention_mask", "logits")
FIXED_TEXT = "The quick brown fox jumps over the lazy dog."  # the inputs when a checkpoint recorded no probe


class ProbeMismatch(FinetuneError):
    """A reloaded model does not reproduce the recorded logits: nothing was published (a failed verification)."""

    exit_code = 1


class LogitProbe:
    """Checkpointed object: ``state_dict()`` runs the live model (eval mode, no grad, train mode restored) on the
    run's probe inputs and returns ``{input_ids, attention_mask, logits}`` (logits fp32 on the CPU).

    ``inputs`` makes the probe inputs (``worker.probe_batch``); it is called once, at the first checkpoint, when
    the data it reads exists. Every rank must call ``state_dict()`` at the same time under sharded backends.
    ``precision``: the run's :class:`finetune.runtime.precision.Precision`; the probe runs under its autocast, as
    training does (a flash-attn model with fp32 weights cannot run outside it). None: no autocast (fp32 training)."""

    optional_in_checkpoint = True  # checkpoints written before probes existed hold none: resume them all the same

    def __init__(self, model: Any, device: Any, inputs: Callable[[], dict[str, Any]], precision: Any = None) -> None:
        self.model, self.device, self._make_inputs, self.precision = model, device, inputs, precision
        self._inputs: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The live model's logits on the probe inputs (a collective under sharded backends)."""
        import torch  # lazy: heavy

        if self._inputs is None:
            self._inputs = {k: v.detach().cpu() for k, v in self._make_inputs().items()}
        was_training = self.model.training
        self.model.eval()
        autocast = self.precision.autocast() if self.precision is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), autocast:
                output = self.model(**{k: v.to(self.device) for k, v in self._inputs.items()})
        finally:
            self.model.train(was_training)
        return {**self._inputs, "logits": output.logits.detach().float().cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the probe is a record of the checkpointed model, not training state."""


@dataclass(frozen=True)
class Probe:
    """Recorded inputs and logits; ``recorded`` is False for fixed inputs whose logits a live model supplied."""

    input_ids: Any
    attention_mask: Any
    logits: Any
    recorded: bool = True

    @property
    def inputs(self) -> dict[str, Any]:
        """The model inputs, as keyword arguments."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    @property
    def tokens(self) -> int:
        """How many real (unpadded) tokens the probe holds."""
        return int(self.attention_mask.sum())

    def tensors(self) -> dict[str, Any]:
        """The probe as a safetensors dict (``merge_check.safetensors`` of an adapter export has this form)."""
        return {"input_ids": self.input_ids.contiguous(), "attention_mask": self.attention_mask.contiguous(),
                "logits": self.logits.contiguous()}


def read(ckpt: Path) -> Probe | None:
    """The probe a checkpoint recorded, or None when it has none (written before probes existed). A probe that
    cannot be read, or is not one finetune records (:func:`finetune.storage.restored.probe_problems`), is a
    damaged checkpoint (RunDirError); call this only after the checkpoint was verified."""
    if not (ckpt / f"{NAME}.json").is_file():
        return None
    try:
        state = read_state(ckpt, NAME)
        values = [state[key] for key in KEYS]
    except Exception as exc:  # bad JSON, a bad safetensors header, a missing key: whatever the bytes make them raise
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise RunDirError(f"{ckpt / (NAME + '.json')}: the recorded probe cannot be read ({type(exc).__name__}: "
                          f"{detail}); the checkpoint is damaged: use another one (--from)") from None
    if found := restored.probe_problems(*values):  # shapes, dtypes, token ids, finite logits
        raise RunDirError(f"{ckpt / (NAME + '.json')}: the recorded probe is not one finetune records "
                          f"({'; '.join(found)}); the checkpoint is damaged: use another one (--from)")
    return Probe(*values)


def fixed_inputs(tokenizer: Any) -> dict[str, Any]:
    """Fixed inputs for a checkpoint without a recorded probe (one sentence through the run's tokenizer)."""
    encoded = tokenizer([FIXED_TEXT], return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def forward_precision(mixed_precision: str, device: Any) -> Any:
    """The :class:`finetune.runtime.precision.Precision` whose ``autocast()`` every forward outside the training process
    runs under (eval, export and its fresh-process check, merge, generate): ``train.mixed_precision`` of the
    model's recipe on ``device`` (a torch device or its type), so that every forward runs in the precision the
    model was trained in (docs/architecture.md, "Semantics"). Without it, fp32 weights with a half-only kernel
    (flash-attn) cannot run."""
    import torch  # lazy: heavy

    from finetune.runtime.precision import Precision  # lazy: imports torch

    return Precision(mixed_precision, torch.device(device).type)


def logits_of(model: Any, inputs: dict[str, Any], mixed_precision: str) -> Any:
    """``model``'s fp32 CPU logits on ``inputs`` (eval mode, no grad, the recipe's ``mixed_precision`` autocast:
    :func:`forward_precision`), on the model's own device."""
    import torch  # lazy: heavy

    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad(), forward_precision(mixed_precision, device).autocast():
        return model(**{k: v.to(device) for k, v in inputs.items()}).logits.detach().float().cpu()


def max_delta(got: Any, expected: Any) -> float:
    """Largest |got - expected|; infinite when the shapes differ or a value is not finite."""
    if tuple(got.shape) != tuple(expected.shape):
        return float("inf")
    delta = float((got.float() - expected.float()).abs().max()) if got.numel() else 0.0
    return delta if delta == delta else float("inf")  # nan -> inf: never within a tolerance


HALF = ("bfloat16", "float16", "bf16", "fp16")  # weight dtypes and autocast modes that compute in 16 bits
HALF_FLOOR, HALF_RELATIVE = 5e-2, 2.0 ** -5  # half precision: at least 0.05, or 1/32 of the largest |logit|


def tolerance(dtype: str, mixed_precision: str, backend: str, quantized: bool, scale: float = 0.0) -> float:
    """Max |delta logit| accepted between the recorded and the reloaded logits (``scale``: the largest |recorded
    logit|, :func:`scale_of`): :func:`logit_tolerance`, whatever ``backend`` computed the record.

    The recorded logits were computed in the training precision on the training device (a GPU: other kernels,
    flash-attn), and the reload runs on this machine in the same precision (:func:`forward_precision`). DeepSpeed's
    engine and FSDP's policy with 16-bit copies of the weights, the others under bf16/fp16 autocast of fp32
    weights, or a 16-bit ``model.dtype``: all are half-precision compute, and a wrong conversion moves the logits
    by their own size. :func:`tolerance_rule` says it in messages."""
    return logit_tolerance(dtype, quantized, mixed_precision, scale)


def logit_tolerance(dtype: str, quantized: bool = False, mixed_precision: str = "no", scale: float = 0.0) -> float:
    """Max |delta logit| accepted between two forwards of the same weights (what :func:`tolerance_rule` says): the
    one tolerance rule of every check (export, eval of a checkpoint, merge).

    float32 compute (fp32 weights, no autocast) accumulates ~1e-6 here: 1e-4. 4-bit kernels (QLoRA's recorded
    logits) are not reproducible to better than ~1e-3 across processes: 2e-2. Half-precision compute (bf16/fp16
    weights, or ``train.mixed_precision`` bf16/fp16 autocast over fp32 weights) rounds every activation and the
    logits themselves to 8 (bf16) or 11 (fp16) significant bits, and a probe recorded on one device (a GPU, with
    flash-attn) is compared with a reload on another (the CPU, with sdpa): the kernels sum in other orders, so a
    rounding can flip in any layer. One bf16 step at a logit of 20 is already 0.125. So half precision accepts
    max(0.05, 1/32 of the largest |logit| of the reference, ``scale``): about four bf16 steps at the largest logit,
    which still refuses a wrong conversion (a missing or swapped layer moves the logits by their own size)."""
    if dtype in HALF or mixed_precision in HALF:
        return max(HALF_FLOOR, HALF_RELATIVE * scale)
    if quantized:
        return 2e-2
    return 1e-4


def tolerance_rule(dtype: str, quantized: bool = False, mixed_precision: str = "no") -> str:
    """What :func:`logit_tolerance` allows for this compute precision, in a few words for messages."""
    if dtype in HALF or mixed_precision in HALF:
        how = f"train.mixed_precision={mixed_precision}" if mixed_precision in HALF else f"model.dtype={dtype}"
        return (f"half-precision compute ({how}): max({HALF_FLOOR:g}, 1/{round(1 / HALF_RELATIVE)} of the largest "
                "|logit|), for 16-bit roundings that differ between devices and kernels")
    return "4-bit kernels" if quantized else "float32 compute"


def scale_of(logits: Any) -> float:
    """The largest |logit| of a reference (what a half-precision tolerance is relative to); 0 when not finite."""
    value = float(logits.float().abs().max()) if logits.numel() else 0.0
    return value if value < float("inf") else 0.0
