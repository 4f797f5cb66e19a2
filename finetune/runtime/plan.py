"""``finetune plan``: the memory one rank will need, worked out before anything is launched.

The model is built on the meta device (no weights are loaded, nothing is allocated) with the same helpers training
uses (:func:`finetune.runtime.modeling.build_config`, :func:`finetune.runtime.peft.apply`), and the backend comes from
:func:`finetune.backends.effective_settings` for ``launch.accelerate_config`` and ``launch.num_processes``. What
is counted, per rank:

* **parameters**: every parameter in the dtype training holds it in: ``model.dtype``; DeepSpeed with bf16/fp16 casts
  the whole model to 16 bits, FSDP with bf16/fp16 does not (its mixed-precision policy keeps the sharded parameters
  in ``model.dtype`` and casts only the copies it gathers to compute with); QLoRA keeps the quantized linear weights
  in 4-bit NF4 (packed bytes plus block statistics, an estimate) and the other parameters in fp32 (peft's
  ``prepare_model_for_kbit_training``).
* **gradients**: trainable parameters only, in their own dtype (autograd accumulates in the parameter's dtype).
* **optimizer states**: torch creates AdamW's ``exp_avg`` and ``exp_avg_sq`` with ``zeros_like(param)`` and a float32
  ``step`` scalar tensor per parameter; SGD keeps a ``momentum_buffer`` only when momentum is not 0. Under DeepSpeed
  the optimizer steps on DeepSpeed's fp32 master partition, so its states are fp32 and it has one step tensor per
  parameter group; **master weights** (that fp32 copy) are a line of their own.
* **sharding** divides those three: single process and DDP by nothing; ZeRO-1 the optimizer states (and master
  weights); ZeRO-2 also the gradients; ZeRO-3 also the parameters (those DeepSpeed keeps whole on every rank,
  fewer than ``stage3_param_persistence_threshold`` = 1e5 elements, are held whole besides their partition);
  FSDP per its sharding strategy (FULL_SHARD, or FSDP2 ``reshard_after_forward: true``: all three; SHARD_GRAD_OP /
  ``reshard_after_forward: false``: gradients
  and optimizer states, the parameters being gathered whole from forward to backward; NO_SHARD: nothing; HYBRID_*:
  the same within one machine). Each rank's share is rounded up per tensor. Offload moves what it offloads to host
  (CPU) memory: DeepSpeed ``offload_optimizer`` the optimizer states, master weights and an fp32 gradient
  partition; ``offload_param`` the parameters; FSDP ``fsdp_offload_params`` parameters, gradients and optimizer
  states. Where parameters are sharded, a rank also holds gathered ones while it computes (**gathered
  parameters**: the parameters outside the decoder layers plus two decoder layers, the one computing and the one
  prefetched), in the dtype the forward computes with: FSDP with bf16/fp16 gathers 16-bit copies of its fp32 shards
  (its policy's ``param_dtype``: FSDP2's unsharded parameters, FSDP1's ``_full_param_padded``; no fp32 whole is
  made). Where FSDP casts but does not reshard after forward (SHARD_GRAD_OP, NO_SHARD), the 16-bit copies of every
  parameter stay from forward to backward (**16-bit parameter copies**). FSDP with gradient accumulation keeps
  whole (unsharded) gradients across a step's micro-steps (``no_sync``) only where the plan with them counted fits
  the smallest visible device (**accumulation gradients**, see :func:`unsharded_accumulation_fits`, which the
  backend asks); otherwise, and on the CPU, it reduce-scatters every micro-step and holds only its shard. DDP keeps
  its gradient buckets, a second copy of the gradients (**DDP gradient buckets**). Under autocast with fp32
  weights, the 16-bit copies of the linear weights are saved for backward (**autocast weight copies**). Autocast
  runs where neither DeepSpeed's engine nor FSDP's policy casts (:class:`finetune.runtime.precision.Precision` asks
  the same backend properties): one process and DDP. Under FSDP it is off, and backward uses the gathered 16-bit
  parameters themselves (freed after forward and gathered again), so no copy is saved.
* **activations** (an ESTIMATE, from the model config): with ``T = micro_batch_size x max_seq_len`` tokens, hidden
  size ``h``, query width ``q = heads x head_dim``, key/value width ``kv = kv_heads x head_dim``, intermediate size
  ``f``, ``L`` layers, ``a`` heads, ``s`` tokens per attention row (``max_seq_len``; ``T`` when packed), ``r`` bytes
  of the residual stream (the dtype of the weights the forward computes with: 16-bit where DeepSpeed or FSDP casts
  them, whose forward then runs wholly in 16 bits) and ``c`` bytes of the compute dtype (16-bit under autocast),
  what one layer saves for backward per token is::

      layer = r*4h + c*(2h + 3q + 2kv + m*f)     m = 4 for a gated MLP (SiLU(gate) * up), else 2
              + a*s*(4 + c' + d)                  only where attention keeps its s x s scores: eager attention,
                                                  or sdpa with attention dropout off CUDA (torch's CPU kernels
                                                  fall back to the math path); 4 = the fp32 softmax, c' = its cast
                                                  to c bytes (0 when c is 4), d = 1 + c with attention dropout
                                                  (mask + dropped probabilities); flash/efficient kernels keep none
              + c*s                               sdpa otherwise: its boolean attention mask ([rows, 1, s, s], the
                                                  block-diagonal one of a packed row, or a padded batch's causal +
                                                  padding mask) becomes an additive mask in the compute dtype on
                                                  every layer call, and the kernel saves it for backward (a padded
                                                  batch without any padding gets none, transformers then skips it)
              + 2h                                hidden dropout > 0: the masks of the two residual dropouts
      mask  = s                                   sdpa as above: the boolean mask, once per forward
      final = r*2h + c*h                          the final norm and the LM head's input
      PEFT (frozen base): layer loses r*2h (the norms' normalized values, kept only for the norm weights'
      gradients) and final is r*h (a frozen norm and LM head keep only the norm's input)
      lora  = (c + 1) * sum(in_features)          LoRA dropout > 0: each adapted module's dropped-out input + mask;
                                                  the frozen linear layers then save no input of their own (no
                                                  weight gradient), so layer loses c*(2h + q + f): the two norms'
                                                  outputs and the inputs of the output and down projections

  A mixture-of-experts layer (the module holding its experts' 3-D weights; ``k`` of ``E`` experts per token, each
  of intermediate size ``f_e``) replaces the MLP's ``c*m*f`` by::

      moe   = e*k*(2h + g*f_e) + E*(r + 8) + 24*k  each routed copy of a token: its input and the expert output
                                                  it is weighted by, g intermediate-sized tensors (4 for SwiGLU,
                                                  7 for GPT-OSS's clamped one); the router's logits and two fp32
                                                  softmaxes (routing, aux loss); sort and gather indices. e = r:
                                                  transformers' grouped_mm experts cast their input to the weights'
                                                  dtype (not autocast), so they keep no 16-bit weight copies either

  (layers without experts keep the dense MLP), and the estimate is ``T*(L*layer + final + lora + mask)`` without
  gradient checkpointing and
  ``T*(L*r*h + final + mask) + T*(layer + lora/L)`` with it (each layer keeps only its input; one layer is
  recomputed at a time). The two norms of a layer save their input, normalized value and 16-bit output (the
  ``r*4h + c*2h``); attention saves q, k, v, its output and the output projection's input; the MLP its gate, up,
  activation and product. It does not count gradients of activations in flight or allocator fragmentation; frozen
  linear layers (LoRA) save somewhat less than it says.
* **logits and loss**: finetune's loss never builds the ``T x vocab`` logits (:mod:`finetune.tasks.losses`): one
  chunk of ``min(T, default_chunk_rows(vocab, device))`` rows (its logits in the compute dtype and their fp32
  softmax, which becomes the chunk's gradient), plus the hidden states' gradient (``T x hidden``) its backward
  assembles, and an fp32 ``vocab x hidden`` buffer when a 16-bit head trains; a classification head's logits
  are ``micro_batch_size x labels``. With gradient checkpointing, backward recomputes the last layer only after the
  loss's tensors and the final norm's are freed: the smaller of the two is taken off once (**not held at once**, a
  negative line), so the device total is the peak of the step, not the sum of two moments.
* **distillation** (``task: distill``): the teacher (``distill.teacher``) is built on the meta device from its
  folder's config.json as the student is, in ``model.dtype``, and counted without gradients or optimizer states
  (**teacher parameters**): whole on every rank under one process, DDP, ZeRO-1/2 and FSDP1, and 1/shard-group on FSDP2
  and ZeRO-3, which shard it as they shard the student (:meth:`finetune.backends.Backend.frozen_module`: ZeRO-3 in
  its 16-bit cast under bf16/fp16, on the host with ``offload_param``; FSDP2 in ``model.dtype``, on the device
  whatever the student offloads). A sharded teacher's head weight ``V x H_teacher`` is copied out of each forward
  in the dtype its forward computes with (**teacher head copy**). Its final hidden states ``T x H_teacher`` (in the
  dtype of its residual stream) are held through the student's forward (**teacher hidden states**). The loss
  (:mod:`finetune.tasks.chunked_divergence`) builds no SFT chunk: the **logits + loss** line keeps the hidden states'
  gradient and the head's fp32 gradient buffer, and **distillation chunk** counts one chunk of ``rows =
  min(T, chunk_rows(vocab))`` (a quarter of the SFT chunk) holding ``n x rows x vocab x 4`` bytes at its peak:
  ``n`` fp32 ``rows x vocab`` tensors (:data:`DIVERGENCE_TENSORS`: both models' logits, the two log-softmaxes and
  the divergence's elementwise terms, measured in ``tests/unit/test_plan_distill.py``). The teacher's forward
  itself (its activations without gradient, a sharded teacher's gathered layers) ends before the student's starts
  and is not counted.

The totals are per rank: device memory (a GPU, or the CPU's memory where the run trains on the CPU) and host
memory (what offload puts in CPU memory). Where CUDA devices are visible, the device total is compared with the
smallest one's memory. DeepSpeed's gradient **reduce bucket** is counted as the worker sizes it
(:func:`finetune.backends.reduce_bucket_elements`: DeepSpeed's 5e8 elements, capped at the trainable
parameters). Not counted: the CUDA context and allocator caches, ZeRO's other communication buffers, DoRA's per-forward
weight-norm temporaries, the eval pass (its logits are noted when they exceed training's activations and logits) and the
generation cache of ``exact_match``.

Checked by ``tests/unit/test_plan.py``: parameters, gradients and optimizer states equal the bytes of a real model
after a real training step (full, LoRA, DoRA, bf16 weights, SGD, BERT; Mixtral, Qwen3-MoE and GPT-OSS, whose
experts are most of the parameters), QLoRA's 4-bit estimate is within 2% of a real bitsandbytes model, and the
activation estimate is within 20% of what autograd really saves (Llama fp32, bf16 autocast, bf16 weights, eager
attention, GQA; BERT fp32 and bf16; the three MoE rows full, bf16 and LoRA). The device total is compared with the
peak of live tensor bytes of real training steps: one process in ``tests/unit/test_plan_measured.py``, each
2-process backend inside the runs of ``tests/distributed/test_backends.py`` (the ratios per backend are in its
docstring), and FSDP1/FSDP2 in bf16 inside the runs of ``tests/distributed/test_fsdp_precision.py``, which also
checks from what autograd saves that autocast copies exist in a 1-process bf16 run and not under FSDP, and the
dtype FSDP gathers.

``run --dry-run`` ends with the same plan, each line commented as ``## `` so the output stays YAML.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from finetune import backends
from finetune.backends import Sharding
from finetune.config.schema import RecipeConfig
from finetune.objectives import needs_reference, objective
from finetune.registry import CAUSAL_TASKS, ROW_TASKS, SupportedModel, recipe_row, row_task
from finetune.runtime import launch
from finetune.runtime import peft as lora
from finetune.runtime.peft import linear_module_names
from finetune.runtime.teacher import adapter_off
from finetune.runtime.teacher import model_config as teacher_model_config

Where = Literal["device", "host"]
# FSDP with gradient accumulation: "unsharded" keeps whole gradients across a window's micro-steps (no_sync, one
# reduce-scatter per step), "reduce_scatter" reduce-scatters every micro-step; "none": not FSDP-sharded gradients
# or no accumulation
Accumulation = Literal["none", "unsharded", "reduce_scatter"]
NF4_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Distillation: the fp32 [rows x vocab] tensors one chunk of finetune.tasks.chunked_divergence's fused loss (with
# gradient) holds at its peak, per distill.loss over the whole vocabulary. forward_kl: the student's and the teacher's
# logits, log q and log p, p = exp(log p), the bool mask p > 0 (a quarter), p * (log p - log q), zeros_like(p) and
# torch.where's result; reverse_kl one more (q carries the gradient, so autograd keeps log q - log p too); jsd the
# mixture's stacked log-probabilities [2 x rows x vocab] and both KL terms' tensors. See divergence_tensors for
# top_k and alpha.
DIVERGENCE_TENSORS = {"forward_kl": 8.25, "reverse_kl": 9.25, "jsd": 14.0}


# --- what the plan is made of -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor of the model built on the meta device."""

    numel: int
    element_size: int  # bytes per element as built (model.dtype; LoRA adapters may be fp32)
    ndim: int
    trainable: bool
    layer: int | None  # index of the decoder layer (the FSDP wrap unit) that holds it; None outside the layers
    linear_weight: bool  # the weight of a linear layer: autocast casts it to 16 bits for every forward
    quantized: bool  # QLoRA: stored as 4-bit NF4


@dataclass(frozen=True)
class ModelShape:
    """The model-config numbers the activation estimate uses."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    num_labels: int
    gated_mlp: bool
    attn_implementation: str
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # mixture of experts (0: a dense model): the layers whose MLP is a set of experts, the experts each token is
    # routed to (top-k) of how many, one expert's intermediate size, and whether the experts compute in the weights'
    # dtype (transformers' grouped_mm experts are not autocast: fp32 weights compute in fp32 under bf16 autocast)
    moe_layers: int = 0
    experts_per_token: int = 0
    experts: int = 0
    expert_intermediate: int = 0
    experts_in_weight_dtype: bool = True
    expert_gate_tensors: int = 4  # intermediate-sized tensors one routed copy saves (SwiGLU: gate, up, act, product)


@dataclass(frozen=True)
class ModelFacts:
    """Everything the plan needs from the model: its parameters, its shape, the LoRA-adapted inputs."""

    task: str
    params: tuple[ParamInfo, ...]
    shape: ModelShape
    adapted_in_features: int  # sum of in_features of LoRA-adapted modules (their dropout saves a copy)

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)


@dataclass(frozen=True)
class Item:
    """One line of the plan: a kind of memory, its size for the whole model, and one rank's share."""

    key: str
    label: str
    per_rank_bytes: int
    whole_bytes: int
    shards: int
    where: Where
    note: str


@dataclass(frozen=True)
class Activations:
    """The activation estimate, with and without gradient checkpointing, and which one the recipe uses."""

    tokens: int
    micro_batch_size: int
    max_seq_len: int
    checkpointing: bool
    checkpointing_reason: str
    with_checkpointing: int
    without_checkpointing: int
    logits_bytes: int  # logits + their gradient + the loss's fp32 chunk
    eval_logits_bytes: int  # one eval batch's logits (no grad), at another time than training
    # with checkpointing: the one recomputed layer (and LoRA share), and the final norm + LM-head input; the first is
    # recomputed only after the second and the logits are freed, so the two never meet
    recomputed_layer: int = 0
    final: int = 0
    # distillation: one chunk of the divergence (both models' logits and its fp32 temporaries), freed in forward as
    # the logits are; its rows (0: not a distillation)
    divergence_bytes: int = 0
    divergence_rows: int = 0

    @property
    def not_at_once(self) -> int:
        """Bytes counted twice when the recipe checkpoints: the smaller of (final tensors + logits) and the
        recomputed layer, which backward holds one after the other."""
        loss = self.logits_bytes + self.divergence_bytes
        return min(self.final + loss, self.recomputed_layer) if self.checkpointing else 0

    @property
    def used(self) -> int:
        return self.with_checkpointing if self.checkpointing else self.without_checkpointing


@dataclass(frozen=True)
class DeviceFit:
    """Whether the device total fits the smallest visible CUDA device."""

    visible: bool
    device: str | None
    device_bytes: int | None
    fits: bool | None
    message: str


@dataclass(frozen=True)
class MemoryPlan:
    """The per-rank memory plan of a recipe."""

    recipe: str
    model_type: str
    peft_method: str
    task: str
    total_params: int
    trainable_params: int
    model_dtype: str
    mixed_precision: str
    compute_dtype: str
    sharding: Sharding
    activations: Activations
    items: tuple[Item, ...]
    fit: DeviceFit
    notes: tuple[str, ...]
    accumulation: Accumulation = "none"  # FSDP with gradient accumulation: what it keeps between micro-steps
    dropout: bool = True  # train.dropout as resolved: false trains with every dropout at 0 (no dropout masks kept)

    @property
    def device_total(self) -> int:
        return sum(i.per_rank_bytes for i in self.items if i.where == "device")

    @property
    def host_total(self) -> int:
        return sum(i.per_rank_bytes for i in self.items if i.where == "host")

    def item(self, key: str) -> Item | None:
        """The line ``key`` (parameters, gradients, optimizer_states, ...), None when the plan has none."""
        return next((i for i in self.items if i.key == key), None)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data: every figure of the table, bytes as integers."""
        data = dataclasses.asdict(self)
        del data["sharding"]["engine"]  # the backend object that answered, not a figure
        data["activations"]["used"] = self.activations.used
        data["device_total_bytes"] = self.device_total
        data["host_total_bytes"] = self.host_total
        return data


# --- the computation (from the facts: nothing is built) ---------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // max(1, b))


def nf4_bytes(numel: int) -> int:
    """Estimated bytes of one bitsandbytes 4-bit NF4 weight with double quantization: the packed 4-bit values, an
    8-bit absmax per block of 64, their fp32 absmax per 256 blocks, and the two small code tables."""
    blocks = _ceil_div(numel, NF4_BLOCK)
    return _ceil_div(numel, 2) + blocks + 4 * _ceil_div(blocks, 256) + 4 * (16 + 256 + 1)


def resolve_sharding(backend: backends.Backend, world: int, num_machines: int = 1,
                     in_this_process: bool = False) -> Sharding:
    """The sharding of ``backend`` (the recipe's accelerate config's) at ``world`` ranks: the backend's own figures
    (:meth:`finetune.backends.Backend.split`).

    ``in_this_process``: one process started without a launcher trains in the CLI's process with no backend at all
    (:func:`finetune.runtime.launch.in_process`), whatever the accelerate config says."""
    return backend.split(world, num_machines, in_this_process)


def scores_materialized(shape: ModelShape, cuda: bool) -> bool:
    """Whether attention keeps its ``s x s`` probabilities for backward: eager attention always; sdpa with attention
    dropout off CUDA too (torch's CPU kernels fall back to the math path for dropout)."""
    return shape.attn_implementation == "eager" or (
        shape.attn_implementation == "sdpa" and shape.attention_dropout > 0 and not cuda)


def _mlp_bytes(shape: ModelShape, r: int, c: int) -> float:
    """What one layer's MLP saves for backward per token, averaged over the layers: a dense MLP ``c*m*f``; a layer of
    experts (top ``k`` of ``E``, intermediate ``f_e``, computing in ``e`` bytes: the weights' with grouped_mm)
    ``e*k*(2h + g*f_e)``: each token's ``k`` routed copies of its input and of the expert output it is weighted by,
    and ``g`` intermediate-sized tensors per copy (4 for SwiGLU, as the dense ``m``; GPT-OSS's clamped SwiGLU 7),
    kept whether the experts train or not (grouped_mm saves its input either way), plus the router's ``E*(r + 8)``
    (its logits, the routing softmax and the aux loss's softmax in fp32) and 24 bytes of indices per routed copy."""
    dense = c * (4 if shape.gated_mlp else 2) * shape.intermediate
    if not shape.moe_layers:
        return dense
    h, k, f = shape.hidden, shape.experts_per_token, shape.expert_intermediate
    e = r if shape.experts_in_weight_dtype else c
    routed = e * k * (2 * h + shape.expert_gate_tensors * f) + shape.experts * (r + 8) + 24 * k
    return (shape.moe_layers * routed + (shape.layers - shape.moe_layers) * dense) / shape.layers


def estimate_activations(shape: ModelShape, *, micro_batch_size: int, max_seq_len: int, packing: bool,
                         residual_bytes: int, compute_bytes: int, lora_in_features: int,
                         cuda: bool = False, frozen_base: bool = False) -> tuple[int, int, int, int]:
    """(without, with) gradient checkpointing: the bytes one rank keeps for backward (module docstring formula);
    then the parts of ``with`` that backward holds one after the other: the recomputed layer, the final tensors.
    ``cuda``: the run trains on a CUDA device (sdpa then keeps no scores even with attention dropout);
    ``frozen_base``: PEFT, the base model's weights get no gradient."""
    h, r, c = shape.hidden, residual_bytes, compute_bytes
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tokens = micro_batch_size * max_seq_len
    row = tokens if packing else max_seq_len
    layer = r * 4 * h + c * (2 * h + 3 * q + 2 * kv) + _mlp_bytes(shape, r, c)
    if frozen_base:  # the norms' normalized values were kept for their weights' gradients only
        layer -= r * 2 * h
    if lora_in_features:  # dropped-out copies replace the inputs only the frozen weights' gradients needed
        layer -= c * (2 * h + q + shape.intermediate)
    mask = 0
    if scores_materialized(shape, cuda):
        layer += shape.heads * row * (4 + (c if c != 4 else 0) + ((1 + c) if shape.attention_dropout > 0 else 0))
    elif shape.attn_implementation == "sdpa":
        layer += c * row  # the boolean mask as an additive one in the compute dtype, made and saved per layer call
        mask = row  # the boolean [rows, 1, s, s] mask itself, built once per forward (kept by checkpointing)
    if shape.hidden_dropout > 0:
        layer += 2 * h  # the bool masks of the two residual-branch dropouts
    final = r * h if frozen_base else r * 2 * h + c * h  # a frozen norm and LM head keep only the norm's input
    lora = (c + 1) * lora_in_features
    without = tokens * (shape.layers * layer + final + lora + mask)
    recomputed = tokens * (layer + lora / max(1, shape.layers))
    with_checkpointing = tokens * (shape.layers * r * h + final + mask) + recomputed
    return math.ceil(without), math.ceil(with_checkpointing), math.ceil(recomputed), tokens * final


def estimate_logits(task: str, shape: ModelShape, tokens: int, micro_batch_size: int, compute_bytes: int,
                    residual_bytes: int = 4, head_trains: bool = True, cuda: bool = False,
                    loss_chunk: bool = True) -> int:
    """What the loss holds (causal LM: :mod:`finetune.tasks.losses` never builds the ``T x vocab`` logits): one
    chunk at a time, its logits in the compute dtype and their fp32 softmax (which becomes the chunk's gradient,
    the logits being freed); the hidden states' gradient its backward assembles (in the weights' dtype); and,
    when the head trains in 16-bit weights, the fp32 ``vocab x hidden`` buffer the head's gradient is summed in
    (with fp32 weights that buffer is the gradient itself, already counted under gradients). A classification
    head's small logits: fp32 copy and gradient. ``loss_chunk`` False: the gradient buffers only (distillation
    computes its chunks itself, :func:`estimate_divergence`)."""
    if ROW_TASKS[task].labels:  # type: ignore[index]
        return micro_batch_size * shape.num_labels * (compute_bytes + 4 + 4)
    from finetune.tasks.losses import default_chunk_rows  # lazy: imports torch

    rows = min(tokens, default_chunk_rows(shape.vocab, "cuda" if cuda else "cpu"))
    chunk = rows * shape.vocab * (4 + compute_bytes) if loss_chunk else 0
    head = 4 * shape.vocab * shape.hidden if head_trains and residual_bytes < 4 else 0
    return chunk + tokens * shape.hidden * residual_bytes + head


def divergence_tensors(loss: str, vocab: int, top_k: int | None = None, alpha: float = 0.0) -> float:
    """How many fp32 ``rows x vocab`` tensors one distillation chunk holds at its peak (an estimate, checked against
    the measured peak in ``tests/unit/test_plan_distill.py``): :data:`DIVERGENCE_TENSORS` over the whole vocabulary;
    with ``top_k``, 5 (the two models' logits, their tempered copies, one whole-vocabulary log-softmax of the
    metrics) plus the divergence's terms over ``k`` of the ``vocab`` columns; one more with ``alpha`` > 0 (the
    student's log-softmax, kept for its cross-entropy's gradient). Measured on the CPU: within 2% over the whole
    vocabulary without ``alpha`` (12% over with it: forward and reverse KL free their terms before the
    cross-entropy's), up to a third over with a ``top_k`` near the vocabulary, never under."""
    whole = DIVERGENCE_TENSORS[loss]
    tensors = whole if top_k is None else 5.0 + whole * min(top_k, vocab) / max(1, vocab)
    return tensors + (1.0 if alpha > 0 else 0.0)


def estimate_divergence(shape: ModelShape, tokens: int, distill: Any, cuda: bool = False) -> tuple[int, int, float]:
    """(rows, bytes, tensors) of one chunk of a distillation's loss (``distill``: the recipe's ``distill``
    section): ``rows = min(T, chunk_rows(vocab))`` (:func:`finetune.tasks.chunked_divergence.chunk_rows`, a
    quarter of the SFT chunk) and ``tensors x rows x vocab x 4`` bytes (:func:`divergence_tensors`)."""
    from finetune.tasks.chunked_divergence import chunk_rows  # lazy: imports torch

    rows = min(tokens, chunk_rows(shape.vocab, "cuda" if cuda else "cpu"))
    tensors = divergence_tensors(distill.loss, shape.vocab, distill.top_k, distill.alpha)
    return rows, math.ceil(tensors * rows * shape.vocab * 4), tensors


def check_fit(device_total: int, devices: Sequence[tuple[str, int]] | None) -> DeviceFit:
    """Compare the per-rank device total with the smallest of ``devices`` ((name, bytes) of each visible CUDA
    device; None or empty: none is visible)."""
    if not devices:
        return DeviceFit(False, None, None, None, "no CUDA device is visible here (torch.cuda.is_available() is "
                         "False): the run would train on the CPU, in host memory")
    name, size = min(devices, key=lambda d: d[1])
    fits = device_total <= size
    verdict = "fits" if fits else "does NOT fit"
    hint = "" if fits else ("; shard more (ZeRO-3/FSDP, more processes), offload, enable "
                            "train.gradient_checkpointing or lower train.micro_batch_size / data.max_seq_len")
    return DeviceFit(True, name, size, fits, f"{verdict} in the smallest visible device, {name} with "
                     f"{format_bytes(size)} ({100 * device_total / max(1, size):.1f}% used, before the CUDA "
                     f"context and allocator overhead){hint}")


@dataclass(frozen=True)
class _Precision:
    """The dtypes training will use: what each parameter is held in, and the bytes of activations."""

    engine_half: bool  # DeepSpeed with bf16/fp16 casts the whole model to 16 bits
    qlora: bool  # 4-bit quantized weights; peft upcasts the other parameters to fp32
    residual: int  # bytes per element of the residual stream (the weights' dtype in the forward)
    compute: int  # bytes per element of what the layers compute (16 bits under autocast)
    # the backend casts the weights it computes with to 16 bits (FSDP's mixed-precision policy, param_dtype): the
    # parameters it holds keep model.dtype, the ones it gathers for a forward or backward are 16-bit, and the
    # whole forward (residual stream included) runs on them, as under DeepSpeed's bf16
    backend_casts: bool = False
    # torch.autocast runs (finetune.runtime.precision.Precision: bf16/fp16 where neither the engine nor the backend
    # casts), and saves 16-bit copies of the weights for backward
    autocast: bool = False

    @classmethod
    def of(cls, cfg: RecipeConfig, sharding: Sharding) -> _Precision:
        engine = _engine(sharding)
        half = cfg.train.mixed_precision in ("bf16", "fp16")
        engine_half = engine.engine_owns_precision and half
        backend_casts = engine.casts_parameters and half and not engine_half
        qlora = cfg.peft.method == "qlora"
        residual = 2 if engine_half or backend_casts else (4 if qlora else _DTYPE_BYTES[cfg.model.dtype])
        return cls(engine_half, qlora, residual, 2 if half else residual, backend_casts,
                   autocast=half and not engine_half and not backend_casts)

    def held(self, p: ParamInfo) -> int:
        """Bytes of ``p`` as training holds it (its gradient, when it has one, has the same dtype)."""
        if p.quantized:
            return nf4_bytes(p.numel)
        if self.engine_half:
            return 2 * p.numel
        return p.numel * (4 if self.qlora else p.element_size)

    def computed(self, p: ParamInfo) -> int:
        """Bytes of ``p`` as a forward computes with it: where the backend casts, its 16-bit copy (FSDP gathers
        ``param_dtype`` copies: FSDP2's unsharded parameters, FSDP1's ``_full_param_padded``, never an fp32
        whole); else as held. Quantized weights are not floating point, and stay as held."""
        if self.backend_casts and not p.quantized:
            return min(self.held(p), 2 * p.numel)
        return self.held(p)


def _engine(sharding: Sharding) -> backends.Backend:
    """The backend object behind ``sharding`` (one built by hand names its backend only)."""
    return sharding.engine or backends.backend_named(sharding.backend)


def _persistent(p: ParamInfo, sharding: Sharding) -> bool:
    """Whether ZeRO-3 keeps ``p`` whole on every rank (under ``stage3_param_persistence_threshold`` elements)."""
    return p.numel < _engine(sharding).persistence_threshold


def _share(p: ParamInfo, nbytes: int, divisor: int, sharding: Sharding, is_param: bool = False) -> int:
    """One rank's share of ``nbytes`` belonging to ``p``: rounded up. A parameter ZeRO-3 persists is held whole
    besides its partition (DeepSpeed partitions every parameter, ``ds_tensor``, and never frees a persistent
    one's whole data)."""
    if divisor == 1:
        return nbytes
    return _ceil_div(nbytes, divisor) + (nbytes if is_param and _persistent(p, sharding) else 0)


def _state_items(cfg: RecipeConfig, facts: ModelFacts, sharding: Sharding, prec: _Precision) -> list[Item]:
    """Parameters, gradients, optimizer states and DeepSpeed's fp32 master weights (and offloaded gradients)."""
    engine = _engine(sharding)
    deepspeed = engine.keeps_fp32_master_weights  # DeepSpeed's optimizer steps on its fp32 master partition
    params, trainable = facts.params, [p for p in facts.params if p.trainable]
    dtypes = ("4-bit NF4 quantized linear weights (estimate), fp32 others" if prec.qlora
              else "16-bit (DeepSpeed casts the model)" if prec.engine_half else cfg.model.dtype)
    items = [
        Item("parameters", "parameters", sum(_share(p, prec.held(p), sharding.params, sharding, True) for p in params),
             sum(prec.held(p) for p in params), sharding.params, "host" if sharding.params_on_host else "device",
             f"{dtypes}; {facts.total_params:,} parameters"),
        Item("gradients", "gradients", sum(_share(p, prec.held(p), sharding.grads, sharding) for p in trainable),
             sum(prec.held(p) for p in trainable), sharding.grads, "host" if sharding.grads_on_host else "device",
             f"trainable parameters only ({facts.trainable_params:,}), in their dtype"),
    ]
    states = {"adamw": 2, "sgd": 1 if cfg.optim.momentum else 0}[cfg.optim.name]

    def state_bytes(p: ParamInfo) -> int:  # DeepSpeed's optimizer steps on its fp32 master partition
        return 4 * p.numel if deepspeed else prec.held(p)

    groups = int(any(p.ndim >= 2 for p in trainable)) + int(any(p.ndim < 2 for p in trainable))
    steps = (groups if deepspeed else len(trainable)) if cfg.optim.name == "adamw" else 0
    what = {"adamw": "AdamW exp_avg + exp_avg_sq" + (" (fp32, on DeepSpeed's master copy)" if deepspeed
                                                     else " (dtype of each parameter)")
            + f" + {steps} float32 step tensor(s)",
            "sgd": "SGD momentum_buffer" if states else "SGD without momentum: no state"}[cfg.optim.name]
    where: Where = "host" if sharding.optimizer_on_host else "device"
    items.append(Item("optimizer_states", "optimizer states",
                      states * sum(_share(p, state_bytes(p), sharding.optimizer, sharding) for p in trainable)
                      + 4 * steps, states * sum(state_bytes(p) for p in trainable) + 4 * steps, sharding.optimizer,
                      where, what))
    if engine.holds_master_copy(prec.engine_half):
        master = sum(4 * p.numel for p in trainable)
        master_rank = sum(_share(p, 4 * p.numel, sharding.optimizer, sharding) for p in trainable)
        items.append(Item("master_weights", "master weights (fp32)", master_rank, master, sharding.optimizer, where,
                          "DeepSpeed's fp32 copy of the trainable parameters"))
        if sharding.optimizer_on_host:
            items.append(Item("offload_gradients", "offloaded gradients (fp32)", master_rank, master,
                              sharding.optimizer, "host", "DeepSpeed's fp32 gradient partition for the CPU step"))
    return items


def _backend_items(cfg: RecipeConfig, facts: ModelFacts, sharding: Sharding, prec: _Precision) -> list[Item]:
    """What backends and autocast hold besides: DDP's buckets, gathered parameters, autocast's weight copies."""
    items = []
    params = facts.params
    engine = _engine(sharding)
    if engine.keeps_gradient_buckets:
        grads = sum(prec.held(p) for p in params if p.trainable)
        items.append(Item("ddp_buckets", "DDP gradient buckets", grads, grads, 1, "device",
                          "gradient_as_bucket_view is off: the buckets are a second copy of the gradients"))
    if engine.has_reduce_bucket:
        elements = backends.reduce_bucket_elements(sum(p.numel for p in params if p.trainable))
        bucket = elements * prec.residual  # in the model's (engine's) dtype, DeepSpeed's gradient accumulation dtype
        items.append(Item("reduce_bucket", "DeepSpeed reduce bucket", bucket, bucket, 1, "device",
                          f"reduce_bucket_size {elements:,} elements: the default 5e8 capped at the trainable "
                          "parameters (ZeRO-1/2: allocated at each backward; ZeRO-3: for the whole run)"))
    cast = f" ({cfg.train.mixed_precision} copies: the backend's mixed-precision policy)" if prec.backend_casts else ""
    if sharding.gathers:
        gathered = [p for p in params if not _persistent(p, sharding)]  # the persistent ones are whole already
        layers: dict[int, int] = {}
        for p in gathered:
            if p.layer is not None:
                layers[p.layer] = layers.get(p.layer, 0) + prec.computed(p)
        size = min(sum(prec.computed(p) for p in gathered),
                   sum(prec.computed(p) for p in gathered if p.layer is None) + 2 * max(layers.values(), default=0))
        items.append(Item("gathered_parameters", "gathered parameters", size, size, 1, "device",
                          "transient, while computing: the parameters outside the decoder layers + 2 layers" + cast))
    elif prec.backend_casts:  # parameters not resharded after forward (FSDP NO_SHARD, SHARD_GRAD_OP): their
        # 16-bit copies stay whole from forward to backward (FSDP1's _mp_shard / _full_param_padded, FSDP2's
        # unsharded parameters), besides the parameters held
        size = sum(prec.computed(p) for p in params if prec.computed(p) < prec.held(p))
        if size:
            items.append(Item("parameter_copies", "16-bit parameter copies", size, size, 1, "device",
                              f"whole from forward to backward (the strategy does not reshard){cast}"))
    if prec.autocast:
        copies = [p for p in params if p.linear_weight and not p.quantized and prec.held(p) > 2 * p.numel]
        if cfg.train.gradient_checkpointing or prec.qlora:  # the autocast cache (trainable) + the recomputed layer
            layer_numel: dict[int, int] = {}
            for p in copies:
                if p.layer is not None:
                    layer_numel[p.layer] = layer_numel.get(p.layer, 0) + p.numel
            numel = sum(p.numel for p in copies if p.trainable) + max(layer_numel.values(), default=0)
        else:
            numel = sum(p.numel for p in copies)
        if numel:
            items.append(Item("autocast_copies", "autocast weight copies", 2 * numel, 2 * numel, 1, "device",
                              f"{cfg.train.mixed_precision} copies of the fp32 linear weights, saved for backward"))
    return items


def unsharded_accumulation_bytes(cfg: RecipeConfig, facts: ModelFacts, sharding: Sharding) -> int:
    """Bytes of the whole (unsharded) gradients one FSDP rank keeps across the micro-steps of an accumulation window
    when gradient sync is off until its last one (``no_sync``); 0 where that keeps nothing more than training
    already does (gradients not sharded, or no accumulation). In the parameter's dtype, fp32 under bf16/fp16 mixed
    precision (FSDP2 upcasts unsharded accumulated gradients to the fp32 reduce dtype)."""
    if not _engine(sharding).may_keep_unsharded_grads or sharding.grads == 1 or cfg.grad_accum == 1:
        return 0
    prec = _Precision.of(cfg, sharding)
    floor = 4 if cfg.train.mixed_precision in ("bf16", "fp16") else 0
    return sum(max(prec.held(p), floor * p.numel) for p in facts.params if p.trainable)


def _accumulation(cfg: RecipeConfig, facts: ModelFacts, sharding: Sharding, device_total: int,
                  devices: Sequence[tuple[str, int]] | None) -> tuple[Accumulation, Item | None, str | None]:
    """FSDP with gradient accumulation keeps unsharded gradients across a window only where the plan says they fit
    the smallest visible device; otherwise it reduce-scatters every micro-step (its sharded gradients, already
    counted, accumulate). The mode, its line (unsharded) or its note (reduce-scatter)."""
    extra = unsharded_accumulation_bytes(cfg, facts, sharding)
    if not extra:
        return "none", None, None
    if devices and check_fit(device_total + extra, devices).fits:
        return "unsharded", Item("accumulation_gradients", "accumulation gradients (unsharded)", extra, extra, 1,
                                 "device", f"FSDP keeps whole gradients across the {cfg.grad_accum} micro-steps of "
                                 "a step (no_sync): they fit"), None
    why = "they would not fit the smallest visible device" if devices else "no CUDA device is visible to check"
    return "reduce_scatter", None, (f"FSDP reduce-scatters gradients every micro-step ({cfg.grad_accum} per step): "
                                    f"keeping them whole across the window would take {format_bytes(extra)} more "
                                    f"per rank and {why}")


def unsharded_accumulation_fits(cfg: RecipeConfig, device_bytes: int | None) -> bool:
    """The question an FSDP backend asks before a run with gradient accumulation: may it keep unsharded gradients
    across a window's micro-steps (``no_sync``, one reduce-scatter per step) on a device of ``device_bytes``? True
    only when the recipe's plan with them counted fits; False (reduce-scatter every micro-step) otherwise, with no
    device (None), and where the question does not arise. Builds the model on the meta device."""
    plan = build_plan(cfg, devices=[("device", device_bytes)] if device_bytes else [])
    return plan.accumulation == "unsharded"


def _activations(cfg: RecipeConfig, facts: ModelFacts, prec: _Precision, cuda: bool) -> Activations:
    """The activation, logits and eval-logits estimates of the module docstring."""
    shape = facts.shape if cfg.train.dropout else dataclasses.replace(  # train.dropout false: no masks are kept
        facts.shape, attention_dropout=0.0, hidden_dropout=0.0)
    mbs, seq = cfg.train.micro_batch_size, cfg.data.max_seq_len
    record = objective(cfg.task)
    if record is not None and record.groups:  # micro_batch_size counts prompts: each is group_size prompt + completion
        mbs *= cfg.grpo.group_size  # sequences
    checkpointing = cfg.train.gradient_checkpointing or prec.qlora
    reason = ("train.gradient_checkpointing: true" if cfg.train.gradient_checkpointing else
              "QLoRA: peft's prepare_model_for_kbit_training turns it on" if prec.qlora else
              "train.gradient_checkpointing: false")
    lora_in = facts.adapted_in_features if cfg.peft.method != "none" and cfg.peft.dropout > 0 and cfg.train.dropout \
        else 0
    without, with_, recomputed, final = estimate_activations(
        shape, micro_batch_size=mbs, max_seq_len=seq, packing=cfg.data.packing, residual_bytes=prec.residual,
        compute_bytes=prec.compute, lora_in_features=lora_in, cuda=cuda, frozen_base=cfg.peft.method != "none")
    distills = record is not None and record.teacher  # its loss computes its own chunks (the divergence's)
    logits = estimate_logits(facts.task, shape, mbs * seq, mbs, prec.compute, prec.residual,
                             head_trains=cfg.peft.method == "none", cuda=cuda, loss_chunk=not distills)
    from finetune.tasks.losses import default_chunk_rows  # imports torch

    eval_logits = (min(cfg.eval.batch_size * seq, default_chunk_rows(shape.vocab, "cuda" if cuda else "cpu"))
                   * shape.vocab * (prec.compute + 4) if facts.task in CAUSAL_TASKS  # one chunk, no grad
                   else cfg.eval.batch_size * shape.num_labels * 4)
    rows = divergence = 0
    if distills:
        rows, divergence, _ = estimate_divergence(shape, mbs * seq, cfg.distill, cuda)
        # an eval chunk (no gradient) holds at most as many tensors as a training one
        eval_logits = estimate_divergence(shape, cfg.eval.batch_size * seq, cfg.distill, cuda)[1]
    return Activations(mbs * seq, mbs, seq, checkpointing, reason, with_, without, logits, eval_logits, recomputed,
                       final, divergence, rows)


def teacher_sharded(sharding: Sharding) -> bool:
    """Whether the backend shards a distillation's teacher (its ``shards_frozen_module``: FSDP2 and ZeRO-3 do, as
    they shard the student; one process, DDP, ZeRO-1/2 and FSDP1 hold it whole)."""
    return _engine(sharding).shards_frozen_module


def _teacher_items(cfg: RecipeConfig, teacher: ModelFacts, sharding: Sharding, prec: _Precision,
                   acts: Activations) -> list[Item]:
    """A distillation's teacher: its parameters (no gradients, no optimizer states), a sharded teacher's head copy
    and its final hidden states (module docstring)."""
    sharded = teacher_sharded(sharding)
    size = _DTYPE_BYTES[cfg.model.dtype]  # built in model.dtype
    # a sharded teacher computes with what its backend gathers: ZeRO-3's engine casts it to 16 bits, FSDP2's
    # policy gathers 16-bit copies; a whole one computes in its own dtype (autocast leaves its residual stream so)
    cast = sharded and (prec.engine_half or prec.backend_casts)
    held = 2 if sharded and prec.engine_half else size
    computed = min(held, 2) if cast else held
    divisor = sharding.grads if sharded else 1  # the shard group (the teacher reshards after each forward)
    whole = sum(held * p.numel for p in teacher.params)
    share = sum(_share(p, held * p.numel, divisor, sharding, is_param=True) for p in teacher.params)
    where: Where = "host" if sharded and sharding.params_on_host and sharding.zero_stage is not None else "device"
    dtype = "16-bit (DeepSpeed casts it)" if held < size else cfg.model.dtype
    placed = (f"sharded as the student (/{divisor})" if sharded else "whole on every rank")
    items = [Item("teacher_parameters", "teacher parameters", share, whole, divisor, where,
                  f"distill.teacher, frozen: {dtype}; {teacher.total_params:,} parameters, {placed}; no gradients "
                  "or optimizer states")]
    shape = teacher.shape
    dtype_name = {"bf16": "bfloat16", "fp16": "float16"}[cfg.train.mixed_precision] if computed < size \
        else cfg.model.dtype
    if sharded:
        head = shape.vocab * shape.hidden * computed
        items.append(Item("teacher_head_copy", "teacher head copy", head, head, 1, "device",
                          f"the sharded teacher's gathered head weight ({shape.vocab} x {shape.hidden}, {dtype_name}) "
                          "copied out of each forward, held through the student's"))
    hidden = acts.tokens * shape.hidden * computed
    items.append(Item("teacher_hidden", "teacher hidden states", hidden, hidden, 1, "device",
                      f"{acts.micro_batch_size} x {acts.max_seq_len} x {shape.hidden} ({dtype_name}), held through "
                      "the student's forward and loss"))
    return items


def plan_from_facts(cfg: RecipeConfig, facts: ModelFacts, sharding: Sharding,
                    devices: Sequence[tuple[str, int]] | None, teacher: ModelFacts | None = None) -> MemoryPlan:
    """The plan of ``cfg`` for a model described by ``facts`` under ``sharding``; ``devices``: (name, bytes) of the
    visible CUDA devices (none: the run trains on the CPU); ``teacher``: a distillation's teacher (None: none is
    counted)."""
    prec = _Precision.of(cfg, sharding)
    items = _state_items(cfg, facts, sharding, prec) + _backend_items(cfg, facts, sharding, prec)
    record = objective(cfg.task)  # a reference held as a frozen copy (finetune.tasks.grpo's, with grpo.beta > 0)
    if record is not None and record.reference_copy and needs_reference(cfg.task, cfg) and not lora.enabled(cfg.peft):
        params = next(item for item in items if item.key == "parameters")  # backends.frozen_copy: sharded alike
        share = sum(_share(p, prec.held(p), sharding.params, sharding) for p in facts.params)  # shards only
        items.append(Item("grpo_reference", "GRPO reference (frozen copy)", share, params.whole_bytes, params.shards,
                          params.where, "grpo.beta > 0 with full fine-tuning: a frozen copy of the initial weights, "
                          "held as the parameters are (whole, or each rank's shards)"))
    acts = _activations(cfg, facts, prec, cuda=bool(devices))
    if teacher is not None and record is not None and record.teacher:
        items += _teacher_items(cfg, teacher, sharding, prec, acts)
    other = acts.without_checkpointing if acts.checkpointing else acts.with_checkpointing
    items.append(Item("activations", "activations (estimate)", acts.used, acts.used, 1, "device",
                      f"{acts.micro_batch_size} x {acts.max_seq_len} tokens, checkpointing "
                      f"{'on' if acts.checkpointing else 'off'} ({'off' if acts.checkpointing else 'on'}: "
                      f"{format_bytes(other)})"))
    causal = facts.task in CAUSAL_TASKS
    loss_text = ("the hidden states' gradient; the distillation chunk is its own line" if acts.divergence_rows
                 else "one loss chunk + the hidden states' gradient" if causal else "classification logits")
    items.append(Item("logits_loss", "logits + loss", acts.logits_bytes, acts.logits_bytes, 1, "device",
                      loss_text + f" ({facts.shape.vocab if causal else facts.shape.num_labels} columns)"))
    if acts.divergence_rows:
        tensors = divergence_tensors(cfg.distill.loss, facts.shape.vocab, cfg.distill.top_k, cfg.distill.alpha)
        items.append(Item("distill_divergence", "distillation chunk", acts.divergence_bytes, acts.divergence_bytes,
                          1, "device", f"one chunk of {acts.divergence_rows} rows: the student's and the teacher's "
                          f"fp32 logits and the {cfg.distill.loss} divergence's fp32 temporaries, ~{tensors:g} x rows "
                          f"x {facts.shape.vocab} x 4 bytes at its peak (estimate)"))
    if acts.not_at_once:
        items.append(Item("not_at_once", "not held at once", -acts.not_at_once, -acts.not_at_once, 1, "device",
                          "checkpointing: backward recomputes the last layer after the logits, their gradient and "
                          "the final norm's tensors are freed; the smaller of the two is counted once"))
    notes = []
    accumulation, accumulated, note = _accumulation(
        cfg, facts, sharding, sum(i.per_rank_bytes for i in items if i.where == "device"), devices)
    items += [accumulated] if accumulated else []
    notes += [note] if note else []
    if sharding.params > 1 and any(_persistent(p, sharding) for p in facts.params):
        notes.append("ZeRO-3 keeps parameters under 1e5 elements whole on every rank, besides their partition "
                     "(stage3_param_persistence_threshold)")
    if acts.eval_logits_bytes > acts.used + acts.logits_bytes + acts.divergence_bytes:
        notes.append(f"eval: one eval batch's logits ({cfg.eval.batch_size} x {acts.max_seq_len} tokens, no grad) "
                     f"take {format_bytes(acts.eval_logits_bytes)}, more than training's activations + logits; "
                     "lower eval.batch_size if it does not fit")
    mixed = cfg.train.mixed_precision
    compute_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed, "float32" if prec.qlora else cfg.model.dtype)
    device_total = sum(i.per_rank_bytes for i in items if i.where == "device")
    return MemoryPlan(recipe=cfg.name, model_type=cfg.model.type, peft_method=cfg.peft.method, task=facts.task,
                      total_params=facts.total_params, trainable_params=facts.trainable_params,
                      model_dtype=cfg.model.dtype, mixed_precision=mixed, compute_dtype=compute_dtype,
                      sharding=sharding, activations=acts, items=tuple(items),
                      fit=check_fit(device_total, devices), notes=tuple(notes), accumulation=accumulation,
                      dropout=bool(cfg.train.dropout))


# --- the meta-device model and the visible devices (torch) ------------------------------------------------------------


def _shape(config: Any, model: Any, attn_implementation: str | None) -> ModelShape:

    # a vision-language config nests its decoder's: the activations estimated are the decoder's (the vision
    # tower's, for the images of a batch, are not counted)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(config.hidden_size)
    heads = int(getattr(config, "num_attention_heads", None) or 1)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    experts = _experts(model)
    gated = any("gate" in name.rsplit(".", 1)[-1] for name in linear_module_names(model))
    attention = attn_implementation or getattr(config, "_attn_implementation", None) or "sdpa"

    def first(*names: str) -> float:
        return float(next((v for n in names if isinstance(v := getattr(config, n, None), int | float)), 0.0))

    return ModelShape(hidden=hidden, intermediate=int(intermediate), layers=int(config.num_hidden_layers),
                      heads=heads, kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                      head_dim=head_dim, vocab=int(config.vocab_size), num_labels=int(config.num_labels),
                      gated_mlp=gated, attn_implementation=str(attention),
                      attention_dropout=first("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"),
                      hidden_dropout=first("hidden_dropout_prob", "resid_pdrop", "hidden_dropout"),
                      **_expert_shape(config, experts, hidden))


def _experts(model: Any) -> list[Any]:
    """The expert modules of a mixture-of-experts model: those holding 3-D parameters (``[experts, in, out]``:
    transformers 5 fuses each layer's experts into one module), one per MoE layer; empty for a dense model."""
    return [m for m in model.modules() if any(p.ndim == 3 for p in m.parameters(recurse=False))]


def _expert_shape(config: Any, experts: list[Any], hidden: int) -> dict[str, Any]:
    """The :class:`ModelShape` fields of the experts (none for a dense model): their count and intermediate size from
    the down projection's 3-D weight, the top-k from the config, the dtype they compute in from the implementation
    transformers chose (grouped_mm, its default, casts the input to the weights' dtype; eager's F.linear and
    batched_mm's bmm are autocast)."""
    if not experts:
        return {}
    down = next((p for name, p in experts[0].named_parameters(recurse=False) if p.ndim == 3 and "down" in name),
                next(p for p in experts[0].parameters(recurse=False) if p.ndim == 3))
    number, *dims = down.shape
    intermediate = next((d for d in dims if d != hidden), hidden)
    top_k = next((v for n in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
                  if isinstance(v := getattr(config, n, None), int)), 1)
    implementation = getattr(config, "_experts_implementation", None) or "grouped_mm"
    gated = any(hasattr(m, "gate_up_proj") for m in experts)
    return {"moe_layers": len(experts), "experts_per_token": int(top_k), "experts": int(number),
            "expert_intermediate": int(intermediate), "experts_in_weight_dtype": implementation == "grouped_mm",
            # GPT-OSS clamps gate and up (swiglu_limit) and gates with a sigmoid: it keeps both clamped halves, the
            # sigmoid, up + 1 and the product besides the projection's output
            "expert_gate_tensors": 7 if getattr(config, "swiglu_limit", None) else 4 if gated else 2}


def _quantized_modules(model: Any) -> set[str]:
    """QLoRA: the linear layers bitsandbytes would quantize, that is every torch Linear except those transformers
    keeps in full precision (the output embedding, tied weights, the last module)."""
    try:
        from transformers.quantizers.base import get_keys_to_not_convert  # lazy: heavy

        skip = set(get_keys_to_not_convert(model))
    except ImportError:  # another transformers layout: keep at least the output embedding
        output = model.get_output_embeddings()
        skip = {name for name, module in model.named_modules() if module is output}
    return {name for name, module in model.named_modules() if type(module).__name__ == "Linear"
            and not any(name == k or name.startswith(k + ".") for k in skip)}


def model_facts(cfg: RecipeConfig, row: SupportedModel) -> ModelFacts:
    """Build the recipe's model on the meta device (no weights loaded, nothing allocated), apply its PEFT method as
    training does, and describe its parameters."""
    import torch  # lazy: heavy
    import transformers  # lazy: heavy

    from finetune.runtime.modeling import (  # lazy: imports torch
        DTYPES,
        attention_support,
        build_config,
        freeze,
        loading,
    )

    labels = lora._label_names(cfg) if row_task(row).labels else None
    config = build_config(cfg.model, row, labels=labels)
    # flash-attn may not be installed here; it keeps no s x s scores, like sdpa, which the meta model gets instead
    impl = cfg.model.attn_implementation
    attention = {"attn_implementation": impl} if impl and impl != "flash_attention_2" else {}
    where = cfg.model.path or "its config (model.config_overrides)"
    with loading("model", where, key="model.path" if cfg.model.path else "model.config_overrides"), \
            attention_support(cfg.model, row), torch.device("meta"):
        model = getattr(transformers, row.auto_class).from_config(
            config, dtype=DTYPES[cfg.model.dtype], **attention,
            trust_remote_code=cfg.model.trust_remote_code)  # safe: the recipe given, as `finetune run` does
    quantized_modules = _quantized_modules(model) if cfg.peft.method == "qlora" else set()
    quantized = {id(m.weight) for name, m in model.named_modules() if name in quantized_modules}
    shape = _shape(model.config, model, impl)
    if cfg.model.freeze:  # as the worker does, before PEFT: a frozen part has no gradient or optimizer state
        freeze(model, row, cfg.model.freeze)
    if lora.enabled(cfg.peft):
        model = lora.apply(model, cfg.peft, row)
    layers = [name for name, m in model.named_modules() if type(m).__name__ == row.decoder_layer]
    linear = {id(m._parameters["weight"]) for _, m in model.named_modules()
              if type(m).__name__ in lora.LINEAR_TYPES and m._parameters.get("weight") is not None}

    def layer_of(name: str) -> int | None:
        return next((i for i, prefix in enumerate(layers) if name.startswith(prefix + ".")), None)

    params = tuple(ParamInfo(numel=p.numel(), element_size=p.element_size(), ndim=p.ndim,
                             trainable=p.requires_grad, layer=layer_of(name), linear_weight=id(p) in linear,
                             quantized=id(p) in quantized) for name, p in model.named_parameters())
    adapted = sum(int(getattr(m, "in_features", 0) or 0) for _, m in model.named_modules()
                  if hasattr(m, "lora_A") and hasattr(m, "base_layer"))
    return ModelFacts(task=row.task, params=params, shape=shape, adapted_in_features=adapted)


def teacher_facts(cfg: RecipeConfig, student: SupportedModel) -> ModelFacts:
    """A distillation's teacher on the meta device, as :func:`finetune.runtime.teacher.build` makes it: from its
    folder's config.json (``distill.teacher``, or a run's ``final/``), read with its model type's row (else the
    student's), in ``model.dtype``, no PEFT, nothing frozen but by its own ``requires_grad_(False)``."""
    model, row = teacher_model_config(cfg, student)
    peft = cfg.peft.model_copy(update={"method": "none"})
    return model_facts(cfg.model_copy(update={"model": model, "peft": peft}), row)


def visible_devices() -> list[tuple[str, int]]:
    """(name, total bytes) of every visible CUDA device; empty without one."""
    import torch  # lazy: heavy

    if not torch.cuda.is_available():
        return []
    return [(f"cuda:{i} {torch.cuda.get_device_name(i)}", int(torch.cuda.get_device_properties(i).total_memory))
            for i in range(torch.cuda.device_count())]


def build_plan(cfg: RecipeConfig, devices: Sequence[tuple[str, int]] | None = None,
               row: SupportedModel | None = None) -> MemoryPlan:
    """The memory plan of a validated recipe: backend from its launch settings, model built on meta.
    ``devices``: (name, bytes) of the devices to check against; None asks torch which CUDA devices are visible.
    ``row``: the recipe's row, where the caller resolved it already (registry.recipe_row)."""
    row = recipe_row(cfg) if row is None else row
    accelerate = backends.accelerate_config(cfg.launch.accelerate_config)
    sharding = resolve_sharding(accelerate.backend, cfg.launch.num_processes, accelerate.machines,
                                in_this_process=cfg.launch.num_processes == 1 and not launch.under_launcher())
    facts = model_facts(cfg, row)
    record = objective(cfg.task)
    # a LoRA student's own base as the teacher (runtime.teacher.adapter_off) is the student: nothing more to hold
    teacher = teacher_facts(cfg, row) if record is not None and record.teacher and cfg.distill.teacher \
        and not adapter_off(cfg) else None
    return plan_from_facts(cfg, facts, sharding, visible_devices() if devices is None else devices, teacher)


# --- output -----------------------------------------------------------------------------------------------------------


def format_bytes(n: int) -> str:
    """1536 -> '1.50 KiB' (binary units); a negative ``n`` (what is not held at once) with a minus sign."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.2f} {unit}"
    return f"{n} B"  # pragma: no cover
