"""The SupportedModel table: what differs per model family, as literal data.

A row names classes by string (resolved from ``transformers`` only when a model is built), so this module is
cheap to import from the CLI. Users add rows for their own families from their own module
(``model.plugin: mypkg.models`` in a recipe) by calling :func:`register`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from finetune.errors import ConfigError

Task = Literal["causal_lm", "classification", "reward"]  # reward: a causal LM row built by for_task(row, "reward")
# "preference": a causal LM row that can train on preference pairs (task: dpo / reward)
CAPABILITIES = frozenset({"packing", "gradient_checkpointing", "generation", "preference"})
TASK_METRICS: Mapping[Task, frozenset[str]] = {
    "causal_lm": frozenset({"token_accuracy", "exact_match"}),
    "classification": frozenset({"accuracy"}),
}
# metrics of the preference objectives (recipe key ``task``), which run on rows with the "preference" capability
PREFERENCE_METRICS: Mapping[str, frozenset[str]] = {
    "dpo": frozenset({"preference_accuracy"}),
    "reward": frozenset({"preference_accuracy"}),
}
TASK_FORMATS: Mapping[Task, frozenset[str]] = {
    "causal_lm": frozenset({"alpaca", "chat", "completion"}),
    "classification": frozenset({"classification"}),
}


@dataclass(frozen=True)
class SupportedModel:
    """One model family.

    ``tiny_config`` holds keyword arguments for a tiny config of the family: tests build every row from it,
    and a ``debug_build`` row builds its model from it when ``model.path`` is null (with the bundled
    ``tokenizer`` asset), so quickstarts and tests need no download.
    """

    name: str
    task: Task
    auto_class: str
    config_class: str
    decoder_layer: str
    lora_targets: Mapping[str, tuple[str, ...]]
    capabilities: frozenset[str]
    tiny_config: Mapping[str, Any]
    head_modules: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()  # the HF config ``model_type`` values this row can load (empty: any)
    reward_head: tuple[str, ...] = ("score",)  # the head of the family's *ForSequenceClassification (for_task)
    debug_build: bool = False
    tokenizer: str | None = None
    description: str = ""


_DECODER_LORA = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "attn_mlp": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "all_linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
_DECODER_CAPS = frozenset({"packing", "gradient_checkpointing", "generation", "preference"})
_TINY_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}

SUPPORTED_MODELS: dict[str, SupportedModel] = {
    "llama": SupportedModel(
        name="llama", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="LlamaConfig",
        decoder_layer="LlamaDecoderLayer", lora_targets=_DECODER_LORA, capabilities=_DECODER_CAPS,
        tiny_config=_TINY_DECODER, model_types=("llama",), description="Llama 2/3 and compatible decoders",
    ),
    "qwen2": SupportedModel(
        name="qwen2", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="Qwen2Config",
        decoder_layer="Qwen2DecoderLayer", lora_targets=_DECODER_LORA, capabilities=_DECODER_CAPS,
        tiny_config=_TINY_DECODER, model_types=("qwen2",), description="Qwen2 / Qwen2.5 decoders",
    ),
    "mistral": SupportedModel(
        name="mistral", task="causal_lm", auto_class="AutoModelForCausalLM", config_class="MistralConfig",
        decoder_layer="MistralDecoderLayer", lora_targets=_DECODER_LORA, capabilities=_DECODER_CAPS,
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
        tiny_config=_TINY_DECODER, model_types=("llama",), debug_build=True, tokenizer="tiny-llama-tokenizer",
        description="debug: 2-layer Llama built from a config + bundled tokenizer (no download)",
    ),
}


def register(row: SupportedModel) -> None:
    """Add (or replace) a row; called by user plugin modules named in ``model.plugin``."""
    if not isinstance(row, SupportedModel) or not isinstance(row.name, str) or not row.name:
        raise ConfigError(f"model.plugin: register() takes a SupportedModel with a name, got {row!r:.80}")
    if row.task not in TASK_METRICS:
        raise ConfigError(f"SupportedModel {row.name!r}: unknown task {row.task!r}; known: {sorted(TASK_METRICS)}")
    unknown = frozenset(row.capabilities) - CAPABILITIES
    if unknown:
        raise ConfigError(f"SupportedModel {row.name!r}: unknown capabilities {sorted(unknown)}; "
                          f"known: {sorted(CAPABILITIES)}")
    if "packing" in row.capabilities and row.task != "causal_lm":
        raise ConfigError(f"SupportedModel {row.name!r}: packing is a causal_lm capability (a {row.task} row packs "
                          "no next-token targets); remove it from capabilities")
    if "preference" in row.capabilities and row.task != "causal_lm":
        raise ConfigError(f"SupportedModel {row.name!r}: preference is a causal_lm capability (task dpo / reward "
                          f"train decoders, not {row.task} rows); remove it from capabilities")
    SUPPORTED_MODELS[row.name] = row


def load_plugin(module: str) -> None:
    """Import a user module that calls :func:`register` (``model.plugin``); whatever it raises is one line."""
    try:
        importlib.import_module(module)
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"model.plugin: cannot import {module!r} ({exc}); "
                          "install it or put it on PYTHONPATH") from None
    except Exception as exc:  # the plugin's own code failed: name it, not our stack
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"model.plugin: importing {module!r} failed ({type(exc).__name__}: {first}); fix the "
                          "plugin module") from None


def model_type_problem(row: SupportedModel, model_type: object, where: str) -> str | None:
    """A one-line error when the weights at ``where`` (config ``model_type``) are not what ``row`` builds."""
    if not row.model_types or model_type in row.model_types:
        return None
    fits = sorted(r.name for r in SUPPORTED_MODELS.values() if model_type in r.model_types and not r.debug_build)
    hint = f"set model.type to {' or '.join(fits)}" if fits else "add a row for it with model.plugin"
    return (f"model.type: {row.name} expects a {'/'.join(row.model_types)} model, but {where} holds a "
            f"{model_type!r} model; {hint}")


REWARD_AUTO_CLASS = "AutoModelForSequenceClassification"


def for_task(row: SupportedModel, task: str | None) -> SupportedModel:
    """The row as a run of the recipe's ``task`` builds it: the one place where the task chooses the model class.

    ``reward`` turns a causal LM row into its reward-model variant: the family's sequence-classification class
    (one output, read at the last token that is not padding; see modeling.build_config), the decoder layers,
    LoRA presets and tiny config unchanged, and the new head (``reward_head``) trained in full under LoRA
    (peft.modules_to_save). It cannot pack or generate. Every other task uses the row as it is."""
    if task != "reward":
        return row
    if row.task != "causal_lm":
        raise ConfigError(f"task: reward scores sequences with a causal LM's sequence-classification head, but "
                          f"model.type {row.name} is a {row.task} model; use a causal LM (e.g. llama, qwen2, gpt2)")
    return dataclasses.replace(row, task="reward", auto_class=REWARD_AUTO_CLASS, head_modules=row.reward_head,
                               capabilities=row.capabilities - {"packing", "generation"})


def recipe_row(cfg: Any) -> SupportedModel:
    """The row a recipe trains: ``model.type`` as the recipe's ``task`` builds it. Every command that builds,
    describes, plans, merges or evaluates a recipe's model asks this, so none can forget the task."""
    return get_model(cfg.model.type, cfg.task)


def get_model(name: str, task: str | None = None) -> SupportedModel:
    """The row for ``name`` as a run of ``task`` (the recipe's ``task`` key) builds it (:func:`for_task`), or a
    ConfigError listing close matches."""
    try:
        row = SUPPORTED_MODELS[name]
    except KeyError:
        close = difflib.get_close_matches(name, SUPPORTED_MODELS, n=3, cutoff=0.4)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(
            f"model.type: unknown model type {name!r}; {hint}known: {', '.join(sorted(SUPPORTED_MODELS))} "
            "(add your own with model.plugin)"
        ) from None
    return for_task(row, task)
