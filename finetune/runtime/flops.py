"""Training FLOPs of a decoder and model FLOPs utilisation (MFU): one formula, one peak table.

Why a module of its own: the GPU check (``scripts/gpu_check.py``) reports MFU today, and training can log it later
from the same numbers. Nothing here imports torch: the model is described by the names, shapes and ``requires_grad``
of its parameters (:class:`Param`), which a meta-device build gives for free (:func:`params_of`).

**The formula.** Only matrix multiplies count (norms, activations, rotary, softmax and the loss are left out, as
``torch.utils.flop_counter.FlopCounterMode`` leaves them out; they are a few percent at most). For a weight of ``n``
elements and one token, training does::

    forward          2n
    input gradient   2n   only if the matmul's input requires grad (something trainable lies upstream)
    weight gradient  2n   only if the weight itself is trainable

so a fully trained model costs the familiar ``6N`` per token, a frozen weight with trainable parts upstream ``4n``
(no weight gradient) and a frozen weight with nothing trainable upstream ``2n`` (no backward at all: e.g. the first
layer's q/k/v projections under LoRA are ``4n``, not ``6n``, and their frozen base weights ``2n``). A LoRA adapter
is two more matmuls (``A``: ``in x r`` reading the layer's input, ``B``: ``r x out`` reading ``A``'s output, both
trainable). The token embedding is a lookup (no FLOPs); the LM head is a matmul (a tied head is trainable with the
embedding).

Attention adds, per layer and per sample of ``s`` tokens, ``4 s^2 q`` in the forward (``Q K^T`` and ``P V``, with
``q`` = heads x head_dim) and ``8 s^2 q`` in the backward when its inputs require grad. That is the full, non-causal
count (PaLM, appendix B; it is also what ``FlopCounterMode`` counts for ``scaled_dot_product_attention``); a causal
kernel executes about half of it. A packed row counts each of its samples, ``sum(s_i^2)``, not the row length
squared: the useful work, which is what MFU measures.

Data flow inside a decoder layer (Llama, Qwen2, Mistral; GPT-2 in brackets): norm -> q, k, v [c_attn] in parallel
-> attention -> o [attn.c_proj] -> norm -> gate, up [c_fc] in parallel -> down [mlp.c_proj]. Phi-3 fuses q, k, v
into qkv_proj and gate, up into gate_up_proj; Qwen3, Gemma 3 and OLMo 2/3 normalise q and k inside attention
(q_norm, k_norm: trainable parameters of the attention stage, no matmul); Gemma and OLMo 2/3 normalise the MLP's
output too (post_feedforward_layernorm, after the MLP stage), and OLMo 2/3's post_attention_layernorm normalises
attention's output where Llama's normalises the MLP's input: both lie between o and the MLP, which is all the
formula needs of a norm. A parameter that sits in a layer but in none of these places (an unknown architecture, a
vision tower) makes :func:`train_flops` return None: the MFU is then omitted, not guessed. DoRA's per-forward
weight norm (independent of the token count) is not counted.

**Peak FLOPs.** Dense bf16 tensor-core throughput from the vendors' datasheets (sparsity figures halved away), by
device name. An unknown device gives None (MFU omitted); ``override_tflops`` (the GPU check's ``--peak-tflops``)
replaces the table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# (name pattern, bf16 dense TFLOPs, what it is). The first match wins, so the narrower patterns come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float, str], ...] = (
    (r"H100.*PCIe", 756.0, "H100 PCIe"),
    (r"H100.*NVL", 0.0, "H100 NVL: not in the table"),  # 0: known but not tabulated -> None, not the SXM figure
    (r"H100", 989.0, "H100 SXM"),
    (r"H200.*NVL", 0.0, "H200 NVL: not in the table"),
    (r"H200", 989.0, "H200 SXM"),
    (r"A100", 312.0, "A100 (SXM and PCIe)"),
    (r"L40S", 362.0, "L40S"),
    (r"A10G", 125.0, "A10G (the A10 datasheet figure; AWS publishes no separate one: check it, or override)"),
    (r"RTX 4090(?! D)", 165.0, "GeForce RTX 4090 (fp32 accumulate)"),
)

_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.(.+)$")
# module paths inside a layer -> data-flow stage; the first matching key wins (attn.c_proj before a bare c_proj)
_STAGES: tuple[tuple[str, int], ...] = (
    ("attn.c_proj", 1), ("mlp.c_proj", 3),
    ("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("qkv_proj", 0), ("c_attn", 0), ("o_proj", 1),
    ("gate_proj", 2), ("up_proj", 2), ("gate_up_proj", 2), ("c_fc", 2), ("down_proj", 3),
)
_NORMS: tuple[tuple[str, int], ...] = (("input_layernorm", 0), ("ln_1", 0), ("post_attention_layernorm", 2),
                                       ("pre_feedforward_layernorm", 2), ("ln_2", 2))
# parameters inside a stage that are no matmul: what trains there makes everything after it require grad
_INSIDE: tuple[tuple[str, int], ...] = (("q_norm", 0), ("k_norm", 0), ("post_feedforward_layernorm", 3))
_EMBEDDINGS = ("embed_tokens", "wte", "wpe")
_HEAD = "lm_head"
_FINAL_NORMS = ("norm", "ln_f")


@dataclass(frozen=True)
class Param:
    """One parameter as the formula needs it: its name in the model, its element count and whether it trains."""

    name: str
    numel: int
    trainable: bool


@dataclass(frozen=True)
class Attention:
    """What the attention term needs: layers and the query width (heads x head_dim)."""

    layers: int
    query_width: int


@dataclass
class _Matmul:
    numel: int
    trainable: bool
    role: str  # "base" | "lora_A" | "lora_B"


@dataclass
class _Stage:
    matmuls: list[_Matmul]
    trainable_other: bool = False  # a bias or another non-matmul parameter of the stage that trains
    norm_trainable: bool = False  # the norm just before the stage trains (its output then requires grad)


def _stage_key(rest: str) -> tuple[int, str] | None:
    """(stage, module key) of a parameter path inside a layer, or None for a norm or an unknown place."""
    for key, stage in _STAGES:
        if rest.startswith(key + ".") or f".{key}." in f".{rest}":
            return stage, key
    return None


def _role(rest: str) -> str:
    if ".lora_A." in rest:
        return "lora_A"
    if ".lora_B." in rest:
        return "lora_B"
    return "base"


def _layers(params: Sequence[Param]) -> tuple[bool, list[list[_Stage]], Param | None] | None:
    """(embedding trains, per layer its four stages, the head) from the parameter list; None if a parameter is in
    a place the formula does not know."""
    embed_trains, head = False, None
    layers: dict[int, list[_Stage]] = {}
    for p in params:
        m = _LAYER.search(p.name)
        if m is None:
            parts = p.name.split(".")
            if any(e in parts for e in _EMBEDDINGS):
                embed_trains |= p.trainable
            elif _HEAD in parts and parts[-1] == "weight":
                head = p
            elif len(parts) < 2 or parts[-2] not in _FINAL_NORMS:
                return None  # a vision tower, a classification head, ...: not a part the formula knows
            continue  # the final norm: after every matmul but the head
        index, rest = int(m.group(1)), m.group(2)
        stages = layers.setdefault(index, [_Stage([]) for _ in range(4)])
        norm = next((s for k, s in _NORMS if rest.startswith(k + ".")), None)
        if norm is not None:
            stages[norm].norm_trainable |= p.trainable
            continue
        inside = next((s for k, s in _INSIDE if rest.startswith(k + ".") or f".{k}." in f".{rest}"), None)
        if inside is not None:
            stages[inside].trainable_other |= p.trainable
            continue
        found = _stage_key(rest)
        if found is None:
            return None
        stage = stages[found[0]]
        if rest.endswith(".weight") and not rest.endswith("lora_magnitude_vector.default.weight") \
                and "lora_embedding" not in rest:
            stage.matmuls.append(_Matmul(p.numel, p.trainable, _role(rest)))
        else:
            stage.trainable_other |= p.trainable
    if not layers:
        return None
    return embed_trains, [layers[i] for i in sorted(layers)], head


def train_flops(params: Sequence[Param], attention: Attention, seq_lens: Iterable[int], *,
                tied_head_numel: int = 0) -> int | None:
    """FLOPs of one training step (forward + backward) over samples of ``seq_lens`` tokens, or None when the model
    has a part the formula does not know. ``tied_head_numel``: the head's size when it is tied to the embedding
    (a tied head is not in the parameter list; it trains with the embedding)."""
    parsed = _layers(params)
    if parsed is None:
        return None
    embed_trains, layers, head = parsed
    lens = list(seq_lens)
    tokens, squares = sum(lens), sum(s * s for s in lens)
    per_token = 0
    grad_upstream = embed_trains  # does the residual stream entering this point require grad?
    attn_backward_layers = 0
    for stages in layers:
        for index, stage in enumerate(stages):
            grad_upstream |= stage.norm_trainable
            adapted_input = grad_upstream
            for mm in stage.matmuls:
                needs_input = adapted_input or (mm.role == "lora_B")  # B reads A's output, and A trains
                per_token += 2 * mm.numel * (1 + int(needs_input) + int(mm.trainable))
            grad_upstream |= stage.trainable_other or any(mm.trainable for mm in stage.matmuls)
            if index == 0 and grad_upstream:
                attn_backward_layers += 1  # q, k, v require grad: attention runs its backward
    head_numel, head_trains = (head.numel, head.trainable) if head is not None else (tied_head_numel, embed_trains)
    per_token += 2 * head_numel * (1 + int(grad_upstream) + int(head_trains))
    attn = 4 * squares * attention.query_width * (attention.layers + 2 * attn_backward_layers)
    return per_token * tokens + attn


def params_of(model: Any) -> list[Param]:
    """The :class:`Param` list of a torch model (meta-device is fine: only names, sizes and flags are read)."""
    return [Param(name, int(p.numel()), bool(p.requires_grad)) for name, p in model.named_parameters()]


def attention_of(config: Any) -> Attention:
    """Layers and query width from a Hugging Face config (its text config for a vision-language model)."""
    text = getattr(config, "text_config", None) or config
    layers = getattr(text, "num_hidden_layers", None) or text.n_layer
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    hidden = getattr(text, "hidden_size", None) or text.n_embd
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return Attention(layers=int(layers), query_width=int(heads * head_dim))


def peak_flops(device_name: str | None, override_tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device, from the table by name; None when unknown (MFU is then omitted)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    for pattern, tflops, _ in PEAK_BF16_TFLOPS:
        if device_name and re.search(pattern, device_name):
            return tflops * 1e12 if tflops else None
    return None


def mfu(flops_per_s_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved over peak, or None when the peak is unknown."""
    return flops_per_s_per_device / peak if peak else None
