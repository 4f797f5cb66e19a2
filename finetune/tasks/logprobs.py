"""Target log-probs of a causal LM, the one mechanism every task's loss goes through: next-token targets, the
shifted loss over logits a caller holds, and the model's forward with its output head swapped for the chunked
log-prob primitive (:func:`finetune.tasks.losses.sequence_logprobs`), per token, per sequence or per completion.

SFT's summed loss (finetune.tasks.causal_lm), DPO's policy and reference sums (finetune.tasks.dpo), GRPO's
per-completion scores (finetune.tasks.grpo) and eval's token accuracy all call :func:`target_logprobs` (or
:func:`head_logprobs` through it); none builds the ``[tokens x vocab]`` logits of a row whose head is named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

from finetune.data.rows import IGNORE
from finetune.errors import ConfigError
from finetune.registry import MODEL_INPUTS, OUTPUT_HEAD, SupportedModel
from finetune.tasks.losses import sequence_logprobs, summed_cross_entropy


@dataclass(frozen=True)
class OutputHead:
    """The output head the log-probs are computed from: the module's name (the row's ``output_head``) and the
    config attributes of what the model's forward does to the head's output afterwards (the row's
    ``logit_divisor`` and ``logit_softcap``), which the loss does per chunk instead (:func:`head_logprobs`)."""

    name: str
    divisor: str | None = None
    softcap: str | None = None


@dataclass(frozen=True)
class Forward:
    """How every task's training forward calls its model, one rule for SFT, DPO and GRPO: the batch keys it passes
    (the row's ``model_inputs``: a custom row's forward may take fewer than a Hugging Face model's; a key the batch
    lacks goes as None, the model's default), the flags it adds (``use_cache=False`` for a Hugging Face model: never
    a KV cache in a training forward, with one transformers skips the packed-sequence detection; nothing for a
    custom row, whose forward takes no such flag) and the output head the log-probs are computed from."""

    keys: tuple[str, ...] = MODEL_INPUTS
    flags: Mapping[str, Any] = field(default_factory=lambda: {"use_cache": False})
    head: OutputHead | None = OutputHead(OUTPUT_HEAD)

    @classmethod
    def of(cls, row: SupportedModel | None) -> Forward:
        """The forward of ``row`` (None: a hand-made config of a task's own fields, a Hugging Face model)."""
        if row is None:
            return cls()
        head = OutputHead(row.output_head, row.logit_divisor, row.logit_softcap) if row.output_head else None
        return cls(row.model_inputs, {} if row.factory else {"use_cache": False}, head)

    def inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The forward's keyword arguments for ``batch``."""
        return {**{key: batch.get(key) for key in self.keys}, **self.flags}


FORWARD = Forward()
"""The forward of a hand-made config of a task's own fields (a Hugging Face model)."""


class LogProbs(NamedTuple):
    """What one forward through :func:`target_logprobs` gives: the target log-prob sums and argmax hits, and the
    router's auxiliary (load-balancing) loss the model returned with them: a mixture-of-experts model whose config
    sets ``output_router_logits`` (None otherwise; the SFT task adds it to its loss, finetune.tasks.router)."""

    sums: torch.Tensor
    hits: torch.Tensor
    aux_loss: torch.Tensor | None = None


def router_aux_loss(out: Any) -> torch.Tensor | None:
    """The ``aux_loss`` tensor of a model's output (transformers' MoE outputs; None for any other output)."""
    aux = out.get("aux_loss") if isinstance(out, Mapping) else getattr(out, "aux_loss", None)
    return aux if isinstance(aux, torch.Tensor) else None


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
    never build those logits (:func:`target_logprobs`)."""
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


def _owner_config(model: Any, head: Any) -> Any:
    """The config of the model whose direct child is ``head`` (through any wrapper: the wrapped model's)."""
    for module in model.modules():
        if any(child is head for child in module.children()):
            return getattr(module, "config", None)
    return None


@contextlib.contextmanager
def _shaping_moved(model: Any, head: Any, spec: OutputHead | None) -> Iterator[tuple[float, float | None]]:
    """The divisor and soft-cap that the model's forward applies to ``head``'s output (read from its config as
    ``spec`` names them; 1 and None: none), with that forward's own switched off while the block runs (the divisor
    set to 1, the soft-cap to None) so the loss can apply them per chunk. Restored afterwards, whatever happens."""
    if spec is None or not (spec.divisor or spec.softcap):
        yield 1.0, None
        return
    config = _owner_config(model, head)
    missing = [name for name in (spec.divisor, spec.softcap) if name and not hasattr(config, name)]
    if missing:
        raise ConfigError(f"the model's config has no {missing[0]!r}, which the row names as what its forward does "
                          "to the output head's logits (logit_divisor / logit_softcap); fix the row")
    divisor = float(getattr(config, spec.divisor)) if spec.divisor else 1.0
    softcap = getattr(config, spec.softcap) if spec.softcap else None
    off = {**({spec.divisor: 1.0} if spec.divisor else {}), **({spec.softcap: None} if softcap is not None else {})}
    saved = {name: getattr(config, name) for name in off}
    try:
        for name, value in off.items():
            setattr(config, name, value)
        yield divisor, None if softcap is None else float(softcap)
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


@dataclass(frozen=True)
class HeadCall:
    """What a computation put in place of an output head receives besides the final hidden states: the head's
    ``weight`` and ``bias`` when it is a plain ``nn.Linear`` (the fused chunked paths), else the head's own
    ``module`` forward (a LoRA-adapted head, called chunk by chunk), and the ``divisor`` and ``softcap`` the model's
    forward would apply to the head's output (:func:`_shaping_moved`), which the computation applies per chunk."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    module: Any
    divisor: float
    softcap: float | None


def through_head(model: Any, inputs: dict[str, Any], head: Any, leading: torch.Size | tuple[int, ...],
                 compute: Any, spec: OutputHead | None = None) -> tuple[Any, torch.Tensor]:
    """One forward of ``model`` on ``inputs`` whose output head ``head`` runs ``compute(hidden [N, H], HeadCall)``
    instead of producing ``[tokens x vocab]`` logits; returns the model's output and what ``compute`` returned.

    The head module's ``forward`` is replaced for the call, so the computation runs inside the model's own forward:
    every wrapper's hooks (DDP, FSDP's unshard and reshard, DeepSpeed ZeRO-3's parameter gathering, autocast, peft)
    see the head called as usual, and the result comes out as the output's ``logits``, which carry the wrappers'
    backward hooks. ``leading``: the shape the hidden states must have but their last dimension (the targets').
    A model that alters the head's output afterwards would make the result wrong, so it is refused, unless ``spec``
    (the row's :class:`OutputHead`) names that change: a division (Granite) or a soft-cap (Gemma) is then done by
    ``compute`` to each chunk's logits, and switched off in the model's config for this forward (a division by 1
    still makes a new tensor: the output is then taken as the head's by the row's word)."""
    own = vars(head).get("forward")
    original = own if own is not None else type(head).forward.__get__(head)
    picked: dict[str, torch.Tensor] = {}

    @torch.compiler.disable  # train.compile: run eagerly, a graph break after the body (inductor cannot lower it)
    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or hidden.shape[:-1] != tuple(leading):
            raise RuntimeError(f"output head {type(head).__name__} was called with {tuple(hidden.shape)}, "
                               f"expected the final hidden states {tuple(leading)} + (hidden,)")
        # a Linear's own forward (FSDP2's FSDPLinear keeps it): fused; an override (LoRA, quantised): the module
        fused = isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
        # divisor, softcap: what _shaping_moved (below) read from the model's config before the model calls this
        picked["out"] = compute(hidden.reshape(-1, hidden.size(-1)), HeadCall(
            head.weight if fused else None, head.bias if fused else None, None if fused else original, divisor,
            softcap))
        return picked["out"]

    head.forward = forward
    try:
        with _shaping_moved(model, head, spec) as (divisor, softcap):
            out = model(**inputs)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    result = out.logits if hasattr(out, "logits") else out
    # the head's own result, or a view of it (DeepSpeed ZeRO-3 hands on a detached alias); never a new tensor but
    # the row's division by 1
    divided = spec is not None and spec.divisor is not None
    if "out" not in picked or not isinstance(result, torch.Tensor) or result.shape != picked["out"].shape \
            or not (divided or torch._C._is_alias_of(result, picked["out"])):
        raise ConfigError(f"the model's forward {'never called' if 'out' not in picked else 'changed what'} its "
                          f"output head ({type(head).__name__}) {'' if 'out' not in picked else 'returned '}(e.g. "
                          "logit soft-capping), so the loss cannot be computed from the head's input; set the row's "
                          "output_head=None to compute it from the logits")
    return out, result


def head_logprobs(model: Any, inputs: dict[str, Any], targets: torch.Tensor, seq: torch.Tensor, sequences: int,
                  head: Any, count_hits: bool = True, temperature: float = 1.0,
                  spec: OutputHead | None = None) -> LogProbs:
    """One forward of ``model`` on ``inputs`` whose output head returns per-sequence target log-prob sums and argmax
    hits (:func:`finetune.tasks.losses.sequence_logprobs`, at ``temperature``: GRPO scores its completions at the
    temperature they were sampled at) instead of ``[tokens x vocab]`` logits (:func:`through_head`), with the
    forward's router aux loss. A plain ``nn.Linear`` head (tied or not) takes the fused chunked path; any other module
    (a LoRA-adapted head) is called chunk by chunk."""
    hits: dict[str, torch.Tensor] = {}

    def compute(flat: torch.Tensor, call: HeadCall) -> torch.Tensor:
        sums, hits["hits"] = sequence_logprobs(
            flat, targets.reshape(-1), seq, sequences, weight=call.weight, bias=call.bias, head=call.module,
            count_hits=count_hits, temperature=temperature, divisor=call.divisor, softcap=call.softcap)
        return sums

    out, sums = through_head(model, inputs, head, targets.shape, compute, spec)
    return LogProbs(sums, hits["hits"], router_aux_loss(out))


Per = Literal["batch", "sequence", "token"]
"""How :func:`target_logprobs` sums a batch's target log-probs: over the whole batch (SFT's summed loss), per
sequence (DPO's and the reward model's pairs) or per target token (GRPO's per-completion-token scores)."""


def _groups(targets: torch.Tensor, per: Per) -> tuple[torch.Tensor, int]:
    """The group each of the ``[S, T]`` target positions (flattened) is summed into, and the number of groups."""
    sequences, length = targets.shape
    if per == "token":
        return torch.arange(sequences * length, device=targets.device), sequences * length
    if per == "sequence":
        return torch.arange(sequences, device=targets.device)[:, None].expand(sequences, length).reshape(-1), sequences
    return torch.zeros(sequences * length, dtype=torch.long, device=targets.device), 1


def target_logprobs(model: Any, inputs: dict[str, Any], targets: torch.Tensor, head_name: OutputHead | str | None,
                    per: Per, count_hits: bool = False, temperature: float = 1.0) -> LogProbs:
    """THE target log-prob primitive every task's loss goes through: the log-prob sums and argmax hits of a batch's
    ``[S, T]`` next-token ``targets`` (0 where IGNORE), summed as ``per`` says: ``[1]`` over the batch, ``[S]`` per
    sequence or ``[S * T]`` per target token, at ``temperature`` (``log_softmax(logits / temperature)``; GRPO scores
    at its sampling temperature). Computed from the final hidden states and the row's output head
    (:func:`head_logprobs`) when the model has one, else from the model's logits, chunk by chunk either way; no host
    sync. Hits are counted only with ``count_hits`` (zeros otherwise). The router aux loss of a mixture-of-experts
    model comes with them (:class:`LogProbs`). ``head_name``: the row's :class:`OutputHead` (a bare name: a head
    whose output the model leaves as it is)."""
    seq, count = _groups(targets, per)
    spec = OutputHead(head_name) if isinstance(head_name, str) else head_name
    head = find_head(model, spec.name if spec is not None else None)
    if head is not None:
        return head_logprobs(model, inputs, targets, seq, count, head, count_hits, temperature=temperature,
                             spec=spec)
    out = model(**inputs)
    logits = out.logits if hasattr(out, "logits") else out
    sums, hits = sequence_logprobs(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), seq, count,
                                   count_hits=count_hits, temperature=temperature)
    return LogProbs(sums, hits, router_aux_loss(out))
