"""The SupportedModel table: what differs per model family, as literal data.

A row names classes by string (resolved from ``transformers`` only when a model is built), so this module is
cheap to import from the CLI. Users add rows for their own families from their own module
(``model.plugin: mypkg.models`` in a recipe) by calling :func:`register`. Such a row may also name any
``torch.nn.Module`` factory (``factory="pkg.module:function"``) instead of Hugging Face classes: a custom model,
resolved by :func:`resolve_factory` only when a model is built or a recipe is validated.

Importing a user's module and calling what it names runs the user's code inside finetune's process:
:func:`user_code` keeps that code from ending the process (``sys.exit``) or taking over its stdout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from finetune import objectives
from finetune.errors import ConfigError, FinetuneError, is_ctrl_c

# reward: a causal LM row built by for_task(row, "reward"); vision_causal_lm: a causal LM that also reads images
Task = Literal["causal_lm", "vision_causal_lm", "classification", "reward"]
# "preference": a causal LM row that can train on preference pairs (task: dpo / reward); "flex_attention": its
# transformers class runs model.attn_implementation=flex_attention (the class declares _supports_flex_attn)
CAPABILITIES = frozenset({"packing", "gradient_checkpointing", "generation", "preference", "flex_attention"})


@dataclass(frozen=True)
class RowTask:
    """The rules of one model row's ``task``, as data: the code asks these fields, never the task's name.

    ``metrics``: the ``eval.metrics`` a ``task: null`` run of it reports (None: a row only a recipe's task builds,
    never registered: ``reward``); ``formats``: the data formats it trains on; ``causal``: next-token logits over
    the vocabulary (the loss works in chunks of them); ``text_causal``: a causal LM over text alone, the one kind of
    row that packs samples, trains on preference pairs, becomes a reward model, may be a custom (factory) model and
    generates for task grpo; ``vision``: it also reads images (the vision batch keys, an ``image_token``);
    ``labels``: a classification head over named labels (recorded with its checkpoints); ``scores``: one score per
    sequence (the reward head: a dead model scores a pair equally)."""

    metrics: frozenset[str] | None
    formats: frozenset[str]
    causal: bool = False
    text_causal: bool = False
    vision: bool = False
    labels: bool = False
    scores: bool = False


ROW_TASKS: Mapping[Task, RowTask] = {
    "causal_lm": RowTask(frozenset({"token_accuracy", "exact_match", "tool_calls"}),
                         frozenset({"alpaca", "chat", "completion"}),
                         causal=True, text_causal=True),
    "vision_causal_lm": RowTask(frozenset({"token_accuracy", "exact_match"}), frozenset({"vision_chat"}),
                                causal=True, vision=True),
    "classification": RowTask(frozenset({"accuracy"}), frozenset({"classification"}), labels=True),
    "reward": RowTask(None, frozenset(), scores=True),
}
CAUSAL_TASKS = frozenset(task for task, rules in ROW_TASKS.items() if rules.causal)  # next-token logits
GENERATING_METRICS = frozenset({"exact_match", "tool_calls"})  # the eval metrics that generate answers
# the tasks a row may have (register): their metrics and formats; the metrics of the recipe's ``task`` values (dpo,
# reward, grpo) are their records' (finetune.objectives)
TASK_METRICS: Mapping[Task, frozenset[str]] = {task: rules.metrics for task, rules in ROW_TASKS.items()
                                               if rules.metrics is not None}
TASK_FORMATS: Mapping[Task, frozenset[str]] = {task: ROW_TASKS[task].formats for task in TASK_METRICS}


def row_task(row: SupportedModel) -> RowTask:
    """The rules of ``row``'s task (:data:`ROW_TASKS`; register admits no other task)."""
    return ROW_TASKS[row.task]

# the batch keys a causal LM forward can take; HF rows take all three (and use_cache=False, see tasks/causal_lm.py)
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
# the sample boundaries of a packed row (finetune.data.batching.PackingCollator), as transformers' flattening collator
# names them: a row that lists them in model_inputs gets them, and flash-attention runs varlen on them with no
# boundary detection in each layer (sdpa and eager ignore them and keep the block-diagonal mask from position_ids)
PACKED_ATTENTION_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# what a vision batch adds (finetune.data.vision.VisionCollator): the image processor's outputs and the mask of
# image tokens (text 0, image 1) that multimodal rotary positions are computed from
VISION_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
# the module whose input is the final hidden states and whose output is the logits (causal rows; see output_head)
OUTPUT_HEAD = "lm_head"
CUSTOM_WEIGHTS = "model.safetensors"  # a custom (factory) row's export: its state dict, no config.json
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True, kw_only=True)
class SupportedModel:
    """One model family.

    ``tiny_config`` holds keyword arguments for a tiny config of the family: tests build every row from it,
    and a ``debug_build`` row builds its model from it when ``model.path`` is null (with the bundled
    ``tokenizer`` asset), so quickstarts and tests need no download.

    A custom (non-Hugging-Face) row sets ``factory`` (``"package.module:function"``) instead of ``auto_class`` and
    ``config_class``: the model is ``function(config: dict, dtype: torch.dtype) -> torch.nn.Module``, built from
    ``tiny_config`` plus ``model.config_overrides`` (it has no config or weights folder: ``model.path`` stays
    null), and its forward returns logits or an object with ``.logits``. ``decoder_layer`` names the module class
    FSDP wraps (matched by class name, so any module works), ``tokenizer`` a bundled asset, a folder or a hub id,
    ``model_inputs`` the batch keys its forward takes (a subset of :data:`MODEL_INPUTS` with input_ids and
    attention_mask), and ``lora_targets`` its module names per preset (empty: no LoRA).

    Vision-language rows (task ``vision_causal_lm``) also name ``image_token``, the placeholder their chat template
    writes for each image (the data repeats it once per image feature), ``extra_wrap``, more module classes FSDP
    wraps (the vision tower's blocks), ``freeze_groups``, the module-name prefixes of each part ``model.freeze``
    can freeze (``vision``, ``projector``, ``language``), and ``lora_exclude``, a regular expression of module
    names LoRA presets never adapt (the vision tower shares linear names with the language model).

    ``output_head`` names the module of a causal row (found by the last part of its name, through wrappers) that
    turns the final hidden states into logits: the loss replaces its output by chunked log-prob sums, so full
    ``[tokens x vocab]`` logits are never built (finetune.tasks.logprobs.head_logprobs). A model that changes the
    head's output afterwards is refused at the first forward; None computes the loss from the model's logits. A
    family whose forward changes the head's output in a known way names the config attributes of that change, and the
    loss does it per chunk instead (the model's own is switched off for the loss's forward; generation and eval keep
    it): ``logit_divisor``, a division of the logits (Granite's ``logits_scaling``), then ``logit_softcap``, a
    soft-cap ``cap * tanh(logits / cap)`` (Gemma's ``final_logit_softcapping``; a null value in the config: none).
    """

    name: str
    task: Task
    decoder_layer: str
    tiny_config: Mapping[str, Any]
    auto_class: str = ""
    config_class: str = ""
    lora_targets: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    capabilities: frozenset[str] = frozenset()
    factory: str | None = None
    model_inputs: tuple[str, ...] = MODEL_INPUTS
    head_modules: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()  # the HF config ``model_type`` values this row can load (empty: any)
    # the head of the family's *ForSequenceClassification (for_task); (): transformers has none, task reward is refused
    reward_head: tuple[str, ...] = ("score",)
    debug_build: bool = False
    tokenizer: str | None = None
    image_token: str | None = None
    extra_wrap: tuple[str, ...] = ()
    freeze_groups: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    lora_exclude: str | None = None
    output_head: str | None = OUTPUT_HEAD
    logit_divisor: str | None = None
    logit_softcap: str | None = None
    description: str = ""

    @property
    def wrap_classes(self) -> tuple[str, ...]:
        """The module classes FSDP wraps as units: the decoder layer, then ``extra_wrap``."""
        return (self.decoder_layer, *self.extra_wrap)


_DECODER_LORA = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "attn_mlp": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "all_linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
_DECODER_CAPS = frozenset({"packing", "gradient_checkpointing", "generation", "preference", "flex_attention"})
_DECODER_INPUTS = (*MODEL_INPUTS, *PACKED_ATTENTION_INPUTS)  # HF decoders take the boundaries through **kwargs
_TINY_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}

# Qwen2-VL / Qwen2.5-VL: a tiny language model (as _TINY_DECODER, with multimodal rotary sections that sum to half
# the head dim) and a tiny vision tower (14-pixel patches, 2x2 merged: a 56x56 image is 4 tokens). The special
# token ids are those of the bundled tiny-qwen2-vl tokenizer (finetune/assets, made by scripts/make_vlm_assets.py).
_VLM_TOKENS = {"image_token_id": 516, "video_token_id": 517, "vision_start_token_id": 514,
               "vision_end_token_id": 515}
_VLM_TEXT = {**_TINY_DECODER, "vocab_size": 576, "max_position_embeddings": 1024, "bos_token_id": None,
             "eos_token_id": 513,
             "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}
_TINY_QWEN2_VL = {"text_config": _VLM_TEXT, **_VLM_TOKENS,
                  "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                                    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}
_TINY_QWEN2_5_VL = {"text_config": _VLM_TEXT, **_VLM_TOKENS,
                    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                      "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                                      "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]}}
# Qwen3-VL: the same inputs and placeholder expansion; interleaved multimodal rotary sections, a learned vision
# position embedding, and DeepStack mergers that feed vision features into early decoder layers (part of the
# projector). Its hub vision tower uses 16-pixel patches; the tiny one uses 14 so the bundled processor fits it.
_TINY_QWEN3_VL = {"text_config": {**_VLM_TEXT, "rope_parameters": {
                      "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                      "rope_theta": 10000.0}}, **_VLM_TOKENS,
                  "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                    "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                                    "temporal_patch_size": 2, "num_position_embeddings": 64,
                                    "deepstack_visual_indexes": [0]}}
# Mixture-of-experts decoders. In transformers 5 each layer's experts are one module holding fused 3-D parameters
# (gate_up_proj [experts, ...], down_proj), not linear modules, and the router is a module of its own with a plain
# weight (Mixtral's and Qwen3-MoE's `gate`, GPT-OSS's `router`): peft's LoRA adapts linear modules, so every preset of
# these rows adapts the attention projections, and the experts and the router train only in full fine-tuning
# (peft.method: none). The tiny configs turn the router's load-balancing loss on (output_router_logits) with the
# coefficient of the family's hub checkpoints (Mixtral-8x7B 0.02, Qwen3-30B-A3B 0.001, gpt-oss 0.9), so tests train
# with it; hub configs ship it off (finetune.tasks.router).
_MOE_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MOE_LORA = {"attn": _MOE_ATTN, "attn_mlp": _MOE_ATTN, "all_linear": _MOE_ATTN}
_TINY_MOE = {**_TINY_DECODER, "num_experts_per_tok": 2, "output_router_logits": True}
_TINY_MIXTRAL = {**_TINY_MOE, "intermediate_size": 64, "num_local_experts": 4, "router_aux_loss_coef": 0.02}
_TINY_QWEN3_MOE = {**_TINY_MOE, "moe_intermediate_size": 64, "num_experts": 4, "head_dim": 16,
                   "norm_topk_prob": True, "router_aux_loss_coef": 0.001}
# GPT-OSS: attention sinks (a learned logit per head), alternating sliding-window (8 tokens here, 128 on the hub) and
# full layers, YaRN rotary positions and biased projections, as its hub config; sizes multiples of 32, the MXFP4 block
_TINY_GPT_OSS = {**_TINY_MOE, "intermediate_size": 64, "num_local_experts": 4, "head_dim": 16,
                 "router_aux_loss_coef": 0.9, "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention"],
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False}}
_MOE_NOTE = "LoRA presets: attention only; experts and router train in full fine-tuning"

_VLM_LORA = {"attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
             "attn_mlp": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
             "all_linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
_VLM_FREEZE = {"vision": ("model.visual.patch_embed", "model.visual.blocks"), "projector": ("model.visual.merger",),
               "language": ("model.language_model", "lm_head")}
_QWEN3_VL_FREEZE = {"vision": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
                    "projector": ("model.visual.merger", "model.visual.deepstack_merger_list"),
                    "language": ("model.language_model", "lm_head")}
_VLM_COMMON: dict[str, Any] = {
    "task": "vision_causal_lm", "auto_class": "AutoModelForImageTextToText", "lora_targets": _VLM_LORA,
    "capabilities": frozenset({"generation", "gradient_checkpointing"}), "image_token": "<|image_pad|>",
    "model_inputs": ("input_ids", "attention_mask", *VISION_INPUTS), "freeze_groups": _VLM_FREEZE,
    "lora_exclude": r".*\bvisual\..*", "tokenizer": "tiny-qwen2-vl",
}

# The dense decoder families of 2025-26. Their tiny configs are _TINY_DECODER with the bundled tiny tokenizer's
# special ids (several families default to ids beyond a 512-token vocabulary) and with what makes the family itself
# show in 2 layers: a sliding-window layer next to a full one (a window of 4, shorter than the samples the tests
# pack), a NoPE layer, partial rotary, Granite's multipliers, tied embeddings where the small checkpoints tie them,
# and Gemma 2's soft-caps small enough to bend a tiny model's small scores (its checkpoints cap at 50 and 30).
_TINY_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_TINY_DENSE = {**_TINY_DECODER, **_TINY_IDS}
_TINY_WINDOWS = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
_TINY_GEMMA = {**_TINY_DENSE, **_TINY_WINDOWS, "head_dim": 16, "query_pre_attn_scalar": 16}
# Phi-3 / Phi-4-mini fuse q, k and v into qkv_proj and gate and up into gate_up_proj: a preset adapts the fused
# matrices whole (attn: qkv_proj + o_proj; attn_mlp and all_linear add gate_up_proj + down_proj)
_PHI3_LORA = {"attn": ("qkv_proj", "o_proj"), "attn_mlp": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
              "all_linear": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
_DENSE: dict[str, Any] = {"task": "causal_lm", "auto_class": "AutoModelForCausalLM", "lora_targets": _DECODER_LORA,
                          "capabilities": _DECODER_CAPS, "model_inputs": _DECODER_INPUTS}

SUPPORTED_MODELS: dict[str, SupportedModel] = {
    "llama": SupportedModel(
        name="llama", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="LlamaConfig",
        decoder_layer="LlamaDecoderLayer", lora_targets=_DECODER_LORA, capabilities=_DECODER_CAPS,
        model_inputs=_DECODER_INPUTS,
        tiny_config=_TINY_DECODER, model_types=("llama",), description="Llama 2/3 and compatible decoders",
    ),
    "qwen2": SupportedModel(
        name="qwen2", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="Qwen2Config",
        decoder_layer="Qwen2DecoderLayer", lora_targets=_DECODER_LORA, capabilities=_DECODER_CAPS,
        model_inputs=_DECODER_INPUTS,
        tiny_config=_TINY_DECODER, model_types=("qwen2",), description="Qwen2 / Qwen2.5 decoders",
    ),
    "mistral": SupportedModel(
        name="mistral", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="MistralConfig",
        decoder_layer="MistralDecoderLayer", lora_targets=_DECODER_LORA, capabilities=_DECODER_CAPS,
        model_inputs=_DECODER_INPUTS,
        tiny_config=_TINY_DECODER, model_types=("mistral",), description="Mistral decoders",
    ),
    "gpt2": SupportedModel(
        name="gpt2", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="GPT2Config",
        decoder_layer="GPT2Block",
        lora_targets={
            "attn": ("c_attn", "attn.c_proj"),
            "attn_mlp": ("c_attn", "c_proj", "c_fc"),
            "all_linear": ("c_attn", "c_proj", "c_fc"),
        },
        # GPT-2 uses absolute position embeddings and ignores position_ids resets: no packing.
        capabilities=frozenset({"gradient_checkpointing", "generation", "preference"}),
        tiny_config={"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 512},
        model_types=("gpt2",), description="GPT-2 family",
    ),
    "bert": SupportedModel(
        name="bert", task="classification", auto_class="AutoModelForSequenceClassification",
        config_class="BertConfig", decoder_layer="BertLayer",
        lora_targets={
            "attn": ("query", "key", "value", "attention.output.dense"),
            "attn_mlp": ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"),
            "all_linear": ("query", "key", "value", "dense"),
        },
        capabilities=frozenset({"gradient_checkpointing"}),
        tiny_config={"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512},
        head_modules=("classifier",), model_types=("bert",),
        description="BERT encoders for sequence classification (e.g. all-MiniLM-L6-v2)",
    ),
    "tiny-llama": SupportedModel(
        name="tiny-llama", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="LlamaConfig",
        decoder_layer="LlamaDecoderLayer", lora_targets=_DECODER_LORA, capabilities=_DECODER_CAPS,
        model_inputs=_DECODER_INPUTS,
        tiny_config=_TINY_DECODER, model_types=("llama",), debug_build=True, tokenizer="tiny-llama-tokenizer",
        description="debug: 2-layer Llama built from a config + bundled tokenizer (no download)",
    ),
    "tiny-llama-tools": SupportedModel(
        name="tiny-llama-tools", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="LlamaConfig",
        decoder_layer="LlamaDecoderLayer", lora_targets=_DECODER_LORA, capabilities=_DECODER_CAPS,
        model_inputs=_DECODER_INPUTS,
        tiny_config={**_TINY_DECODER, "vocab_size": 1024, "bos_token_id": 1, "eos_token_id": 5, "pad_token_id": 0},
        model_types=(), debug_build=True, tokenizer="tiny-tools-tokenizer",  # no config.json is read as this row
        description="debug: tiny-llama with the bundled tool-calling tokenizer (hermes template; the tools quickstart)",
    ),
    "qwen3": SupportedModel(
        name="qwen3", config_class="Qwen3Config", decoder_layer="Qwen3DecoderLayer", model_types=("qwen3",),
        tiny_config={**_TINY_DENSE, "head_dim": 16, "tie_word_embeddings": True}, **_DENSE,
        description="Qwen3 dense decoders (0.6B-32B; the small ones tie their embeddings)",
    ),
    "gemma2": SupportedModel(
        name="gemma2", config_class="Gemma2Config", decoder_layer="Gemma2DecoderLayer", model_types=("gemma2",),
        tiny_config={**_TINY_GEMMA, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0},
        logit_softcap="final_logit_softcapping", **_DENSE,
        description="Gemma 2 (soft-capped attention: eager, flex_attention or flash_attention_2, not sdpa)",
    ),
    "gemma3_text": SupportedModel(
        name="gemma3_text", config_class="Gemma3TextConfig", decoder_layer="Gemma3DecoderLayer",
        model_types=("gemma3_text",), tiny_config=_TINY_GEMMA, logit_softcap="final_logit_softcapping", **_DENSE,
        description="Gemma 3 text-only decoders (1B, and the text part of larger ones)",
    ),
    "phi3": SupportedModel(
        name="phi3", config_class="Phi3Config", decoder_layer="Phi3DecoderLayer", model_types=("phi3",),
        tiny_config={**_TINY_DENSE, "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
        **{**_DENSE, "lora_targets": _PHI3_LORA},
        description="Phi-3 / Phi-3.5 / Phi-4-mini (fused qkv_proj and gate_up_proj)",
    ),
    "olmo2": SupportedModel(
        name="olmo2", config_class="Olmo2Config", decoder_layer="Olmo2DecoderLayer", model_types=("olmo2",),
        tiny_config=_TINY_DENSE, **_DENSE, description="OLMo 2 decoders",
    ),
    "olmo3": SupportedModel(
        name="olmo3", config_class="Olmo3Config", decoder_layer="Olmo3DecoderLayer", model_types=("olmo3",),
        tiny_config={**_TINY_DENSE, **_TINY_WINDOWS}, **_DENSE,
        description="OLMo 3 decoders (sliding-window and full layers)",
    ),
    "granite": SupportedModel(
        name="granite", config_class="GraniteConfig", decoder_layer="GraniteDecoderLayer", model_types=("granite",),
        tiny_config={**_TINY_DENSE, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                     "attention_multiplier": 0.0625, "logits_scaling": 8.0, "tie_word_embeddings": True},
        logit_divisor="logits_scaling", reward_head=(), **_DENSE,
        description="IBM Granite 3.x dense decoders (no reward variant: transformers has no sequence classifier)",
    ),
    "smollm3": SupportedModel(
        name="smollm3", config_class="SmolLM3Config", decoder_layer="SmolLM3DecoderLayer", model_types=("smollm3",),
        tiny_config={**_TINY_DENSE, "no_rope_layers": [1, 0]}, **_DENSE,
        description="SmolLM3 (every fourth layer without rotary positions)",
    ),
    "mixtral": SupportedModel(
        name="mixtral", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="MixtralConfig",
        decoder_layer="MixtralDecoderLayer", lora_targets=_MOE_LORA, capabilities=_DECODER_CAPS,
        model_inputs=_DECODER_INPUTS, tiny_config=_TINY_MIXTRAL, model_types=("mixtral",),
        description=f"Mixtral mixture-of-experts decoders ({_MOE_NOTE})",
    ),
    "qwen3_moe": SupportedModel(
        name="qwen3_moe", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="Qwen3MoeConfig",
        decoder_layer="Qwen3MoeDecoderLayer", lora_targets=_MOE_LORA, capabilities=_DECODER_CAPS,
        model_inputs=_DECODER_INPUTS, tiny_config=_TINY_QWEN3_MOE, model_types=("qwen3_moe",),
        description=f"Qwen3-MoE decoders, e.g. Qwen3-30B-A3B ({_MOE_NOTE})",
    ),
    # GPT-OSS: its attention sinks live in the eager attention (the model's default: transformers refuses sdpa for
    # it); flash-attn 2 would drop them (finetune.runtime.modeling refuses it) and flex attention keeps them on CUDA
    # only. Its masks are made without position ids, so packed samples would attend to each other: no packing.
    # Hub checkpoints hold MXFP4 experts, dequantized to model.dtype at load (finetune.runtime.modeling).
    "gpt_oss": SupportedModel(
        name="gpt_oss", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="GptOssConfig",
        decoder_layer="GptOssDecoderLayer", lora_targets=_MOE_LORA,
        capabilities=frozenset({"gradient_checkpointing", "generation", "preference"}),
        tiny_config=_TINY_GPT_OSS, model_types=("gpt_oss",),
        description=f"GPT-OSS mixture of experts (MXFP4 experts loaded as model.dtype; eager attention with sinks; "
                    f"no packing; {_MOE_NOTE})",
    ),
    "qwen2_vl": SupportedModel(
        name="qwen2_vl", config_class="Qwen2VLConfig", decoder_layer="Qwen2VLDecoderLayer",
        extra_wrap=("Qwen2VLVisionBlock",), tiny_config=_TINY_QWEN2_VL, model_types=("qwen2_vl",), **_VLM_COMMON,
        description="Qwen2-VL vision-language models (images in chat messages)",
    ),
    "qwen2_5_vl": SupportedModel(
        name="qwen2_5_vl", config_class="Qwen2_5_VLConfig", decoder_layer="Qwen2_5_VLDecoderLayer",
        extra_wrap=("Qwen2_5_VLVisionBlock",), tiny_config=_TINY_QWEN2_5_VL, model_types=("qwen2_5_vl",),
        **_VLM_COMMON, description="Qwen2.5-VL vision-language models (images in chat messages)",
    ),
    "qwen3_vl": SupportedModel(
        name="qwen3_vl", config_class="Qwen3VLConfig", decoder_layer="Qwen3VLTextDecoderLayer",
        extra_wrap=("Qwen3VLVisionBlock",), tiny_config=_TINY_QWEN3_VL, model_types=("qwen3_vl",),
        **{**_VLM_COMMON, "freeze_groups": _QWEN3_VL_FREEZE},
        description="Qwen3-VL vision-language models (dense; images in chat messages)",
    ),
    "tiny-qwen2-vl": SupportedModel(
        name="tiny-qwen2-vl", config_class="Qwen2VLConfig", decoder_layer="Qwen2VLDecoderLayer",
        extra_wrap=("Qwen2VLVisionBlock",), tiny_config=_TINY_QWEN2_VL, model_types=("qwen2_vl",), debug_build=True,
        **_VLM_COMMON, description="debug: tiny Qwen2-VL built from a config + bundled tokenizer and image processor",
    ),
}
# The rows finetune ships, as this module defines them: what the docs' table of model families lists, whatever a
# plugin's register() later adds to or replaces in SUPPORTED_MODELS in the same process.
SHIPPED: Mapping[str, SupportedModel] = MappingProxyType(dict(SUPPORTED_MODELS))


# Rows derived at run time for a causal LM whose family has no row (finetune.config.families): kept apart from the
# table, which holds the tested families (`finetune models`, the docs' table of model families); get_model finds both.
# A process derives them again from the model's config.json when it validates the recipe (the recipe records the
# name), so a derived row is never stored.
DERIVED: dict[str, SupportedModel] = {}


def register(row: SupportedModel) -> None:
    """Add (or replace) a row; called by user plugin modules named in ``model.plugin``."""
    problem = row_problem(row)
    if problem:
        raise ConfigError(problem)
    SUPPORTED_MODELS[row.name] = row


def row_problem(row: SupportedModel) -> str | None:
    """The one line that refuses ``row`` (what :func:`register` checks), or None for a row finetune can build."""
    if not isinstance(row, SupportedModel) or not isinstance(row.name, str) or not row.name:
        return f"model.plugin: register() takes a SupportedModel with a name, got {row!r:.80}"
    if row.task not in TASK_METRICS:
        return f"SupportedModel {row.name!r}: unknown task {row.task!r}; known: {sorted(TASK_METRICS)}"
    unknown = frozenset(row.capabilities) - CAPABILITIES
    if unknown:
        return f"SupportedModel {row.name!r}: unknown capabilities {sorted(unknown)}; known: {sorted(CAPABILITIES)}"
    rules = row_task(row)
    if "packing" in row.capabilities and not rules.text_causal:
        return (f"SupportedModel {row.name!r}: packing is a causal_lm capability (a {row.task} row packs no "
                "next-token targets); remove it from capabilities")
    if "preference" in row.capabilities and not rules.text_causal:
        return (f"SupportedModel {row.name!r}: preference is a causal_lm capability (task dpo / reward train "
                f"decoders, not {row.task} rows); remove it from capabilities")
    problem = _class_problem(row) or _inputs_problem(row) or _vision_problem(row) or _head_problem(row)
    return f"SupportedModel {row.name!r}: {problem}" if problem else None


def _class_problem(row: SupportedModel) -> str | None:
    """How the row builds its model: Hugging Face classes, or a factory (then a causal LM with a tokenizer)."""
    if row.factory is None:
        if not (row.auto_class and row.config_class):
            return "set auto_class and config_class (Hugging Face classes), or factory='package.module:function'"
        return None
    if not isinstance(row.factory, str) or not _FACTORY.fullmatch(row.factory):
        return f"factory must be 'package.module:function', got {row.factory!r}"
    if row.auto_class or row.config_class:
        return "a factory row builds its own model; remove auto_class and config_class"
    if not row_task(row).text_causal:
        return f"a factory row must be a causal_lm model (got task {row.task!r})"
    if not row.tokenizer:
        return "a factory row has no model folder to take a tokenizer from; set tokenizer (asset, folder or hub id)"
    return None


def _inputs_problem(row: SupportedModel) -> str | None:
    """``model_inputs``: known batch keys, with the two every forward gets (eval, logit probes); packing needs
    position ids."""
    inputs = tuple(row.model_inputs)
    known = MODEL_INPUTS + PACKED_ATTENTION_INPUTS + (VISION_INPUTS if row_task(row).vision else ())
    unknown = [key for key in inputs if key not in known]
    if unknown:
        return f"model_inputs {unknown} are not batch keys; use some of {list(known)}"
    if not {"input_ids", "attention_mask"} <= set(inputs):
        return "model_inputs must include input_ids and attention_mask (eval and the logit probes pass both)"
    if "packing" in row.capabilities and "position_ids" not in inputs:
        return "packing restarts position_ids for every sample; add position_ids to model_inputs or drop packing"
    return None


def _vision_problem(row: SupportedModel) -> str | None:
    """A vision-language row names the placeholder token of its images; ``freeze_groups`` maps part names to
    module-name prefixes; ``lora_exclude`` is a regular expression."""
    vision = row_task(row).vision
    if vision != bool(row.image_token):
        return ("a vision_causal_lm row sets image_token (the placeholder its chat template writes per image)"
                if row.image_token is None else "image_token is for vision_causal_lm rows; set task or remove it")
    if vision and row.factory is not None:
        return "a vision_causal_lm row builds a Hugging Face model; remove factory"
    bad = [name for name, prefixes in row.freeze_groups.items()
           if not isinstance(prefixes, tuple) or not prefixes or not all(isinstance(x, str) and x for x in prefixes)]
    if bad:
        return f"freeze_groups[{bad[0]!r}] must be a non-empty tuple of module-name prefixes"
    if row.lora_exclude is not None:
        try:
            re.compile(row.lora_exclude)
        except re.error as exc:
            return f"lora_exclude is not a regular expression ({exc})"
    return None


def _head_problem(row: SupportedModel) -> str | None:
    """``logit_divisor`` and ``logit_softcap`` name config attributes of a Hugging Face model's output head."""
    shaping = {"logit_divisor": row.logit_divisor, "logit_softcap": row.logit_softcap}
    named = {key: value for key, value in shaping.items() if value is not None}
    bad = [key for key, value in named.items() if not isinstance(value, str) or not value.isidentifier()]
    if bad:
        return f"{bad[0]} names a config attribute (e.g. 'logits_scaling'), got {named[bad[0]]!r}"
    if named and (row.factory is not None or not row.output_head):
        return (f"{next(iter(named))} shapes the logits of a Hugging Face model's output_head; "
                "set output_head or remove it")
    return None


def resolve_factory(row: SupportedModel) -> Callable[..., Any]:
    """The function a factory row names (``package.module:function``), imported now; one ConfigError line naming
    model.plugin and the row when it cannot be imported or is not callable. What it returns runs the factory under
    :func:`user_code`."""
    module_name, _, attribute = (row.factory or "").partition(":")
    where = f"model.plugin: SupportedModel {row.name!r} factory {row.factory!r}"
    module = _import(module_name, where, "fix the module")
    with user_code(where, ConfigError, "fix the module"):  # a module-level __getattr__ is its code too
        function = getattr(module, attribute, None)
    if not callable(function):
        found = "is not callable" if function is not None else "does not exist"
        raise ConfigError(f"{where}: {module_name}.{attribute} {found}; name a function "
                          "(config: dict, dtype) -> torch.nn.Module")

    @functools.wraps(function)
    def build(*args: Any, **kwargs: Any) -> Any:
        with user_code(where, ConfigError, "fix the factory"):
            return function(*args, **kwargs)

    return build


@contextlib.contextmanager
def user_code(what: str, error: type[FinetuneError], fix: str) -> Iterator[None]:
    """Run a user's code (a plugin module's import, a factory, a reward function) as a guest of finetune's process:

    - what it prints goes to stderr, since stdout is finetune's (``finetune eval --json`` prints one JSON object);
    - an exit it asks for is its failure, not finetune's own exit: ``sys.exit(...)`` (of any code, 0 included), a
      KeyboardInterrupt it raises itself, or any other BaseException becomes one ``error`` line that starts with
      ``what`` and ends with ``fix`` (a run that exited 0 here would end with no model and no message);
    - a real Ctrl+C that arrives while it runs (raised by finetune's own SIGINT handler) stays a Ctrl+C.

    Its ordinary exceptions pass unchanged: each caller words them. ``os._exit`` ends the process without raising
    anything, so no guard can catch it."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except Exception:
        raise
    except SystemExit as exc:
        raise error(f"{what}: called sys.exit({_shown(exc.code)}), which would end finetune's process (without its "
                    f"model or a message); {fix}") from None
    except KeyboardInterrupt as exc:
        if is_ctrl_c(exc):
            raise
        raise error(f"{what}: raised KeyboardInterrupt itself (no Ctrl+C was pressed), which would stop finetune "
                    f"as a Ctrl+C does; {fix}") from None
    except BaseException as exc:  # GeneratorExit or a class of its own that no `except Exception` catches
        raise error(f"{what}: raised {type(exc).__name__}, which is not an Exception; {fix}") from None


def _shown(code: object) -> str:
    """An exit code as a message shows it: short, on one line."""
    text = repr(code)
    return text if len(text) <= 80 else text[:77] + "..."


def _import(module: str, where: str, fix: str) -> Any:
    """Import a user's module; whatever it raises (an exit it asks for included, :func:`user_code`) is one
    ConfigError line starting with ``where``."""
    try:
        with user_code(f"{where}: importing {module!r}", ConfigError, fix):
            return importlib.import_module(module)
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import {module!r} ({exc}); install it or put it on PYTHONPATH") from None
    except Exception as exc:  # the user's own code failed: name it, not our stack
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{where}: importing {module!r} failed ({type(exc).__name__}: {first}); {fix}") from None


def load_plugin(module: str) -> None:
    """Import a user module that calls :func:`register` (``model.plugin``); whatever it raises is one line."""
    _import(module, "model.plugin", "fix the plugin module")


def model_type_problem(row: SupportedModel, model_type: object, where: str) -> str | None:
    """A one-line error when the weights at ``where`` (config ``model_type``) are not what ``row`` builds."""
    if not row.model_types or model_type in row.model_types:
        return None
    fits = sorted(r.name for r in SUPPORTED_MODELS.values() if model_type in r.model_types and not r.debug_build)
    hint = (f"set model.type to {' or '.join(fits)}" if fits else "remove model.type (a causal LM then trains with a "
            "row derived from transformers, untested) or add a row for it with model.plugin")
    return (f"model.type: {row.name} expects a {'/'.join(row.model_types)} model, but {where} holds a "
            f"{model_type!r} model; {hint}")


REWARD_AUTO_CLASS = "AutoModelForSequenceClassification"


def for_task(row: SupportedModel, task: str | None) -> SupportedModel:
    """The row as a run of the recipe's ``task`` builds it: the one place where the task chooses the model class.

    ``reward`` turns a causal LM row into its reward-model variant: the family's sequence-classification class
    (one output, read at the last token that is not padding; see modeling.build_config), the decoder layers,
    LoRA presets and tiny config unchanged, and the new head (``reward_head``) trained in full under LoRA
    (peft.modules_to_save). It cannot pack or generate. A row without a ``reward_head`` (its family has no such
    class) is refused. Every other task uses the row as it is."""
    record = objectives.objective(task)
    if record is None or record.builds is None:
        return row
    if row.factory is not None:
        raise ConfigError(f"task: reward needs a Hugging Face sequence-classification class, but model.type "
                          f"{row.name} is a custom model (factory {row.factory}); use task: null")
    if not row_task(row).text_causal:
        raise ConfigError(f"task: reward scores sequences with a causal LM's sequence-classification head, but "
                          f"model.type {row.name} is a {row.task} model; use a causal LM (e.g. llama, qwen2, gpt2)")
    if not row.reward_head:
        raise ConfigError(f"task: reward needs the family's sequence-classification class, which transformers does "
                          f"not have for model.type {row.name}; train it with task: dpo, or a reward model of another "
                          "family")
    return dataclasses.replace(row, task=record.builds, auto_class=REWARD_AUTO_CLASS, head_modules=row.reward_head,
                               capabilities=row.capabilities - {"packing", "generation"})


def recipe_row(cfg: Any, *, as_trained: bool = True) -> SupportedModel:
    """The row a recipe trains: ``model.type`` as the recipe's ``task`` builds it (:func:`for_task`; a hand-made
    config without a ``task`` field gets the type's own row). The one resolver of a recipe's row: each process asks
    it once where it meets the recipe (validation, ``finetune run`` / ``plan``, the worker's build, an opened
    checkpoint) and hands the answer on (prepare.Inputs, the Trainer, the plan, the target), so no module reads the
    table with a task rule of its own. ``as_trained=False``: the model type's own row, before the task turns it into
    a variant: what validation checks the recipe's task against (its lines name the type's own task)."""
    if cfg.model.type is None:  # validation fills it in (finetune.config.families); a hand-made config may not
        raise ConfigError("model.type: not set; set it to a row of `finetune models`, or validate the recipe, which "
                          "reads it from model.path's config.json")
    return get_model(cfg.model.type, getattr(cfg, "task", None) if as_trained else None)


def get_model(name: str, task: str | None = None) -> SupportedModel:
    """The row for ``name`` (a row of the table, else one derived in this process, :data:`DERIVED`) as a run of
    ``task`` (the recipe's ``task`` key) builds it (:func:`for_task`), or a ConfigError listing close matches."""
    try:
        row = SUPPORTED_MODELS[name] if name in SUPPORTED_MODELS else DERIVED[name]
    except KeyError:
        close = difflib.get_close_matches(name, SUPPORTED_MODELS, n=3, cutoff=0.4)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(
            f"model.type: unknown model type {name!r}; {hint}known: {', '.join(sorted(SUPPORTED_MODELS))} "
            "(add your own with model.plugin)"
        ) from None
    return for_task(row, task)
