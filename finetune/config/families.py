"""The model family of a recipe's model: ``model.type`` read from the model's own config.json when a recipe leaves it
out, and a row derived from transformers' classes for a causal LM whose family has no row in the table.

A recipe that leaves ``model.type`` out (null) gets the row whose ``model_types`` list the ``model_type`` of
model.path's config.json: a local folder's, or a hub repository's (read from the hub cache offline, fetched alone
online). Of several such rows: one that is not a debug row, then the one named like the model type, then the first
in the table (``llama`` and the debug ``tiny-llama`` both list ``llama``: ``llama``). The type found is written into
the recipe, so the run's resolved recipe names it for resume, eval, export, merge and generate. Validation does this
in every process that reads a recipe (:func:`resolve`).

No row lists it: a causal LM trains with a row derived from its transformers class, for a model type whose class in
transformers' causal-LM mapping is a ``*ForCausalLM``, which is not also a masked-LM (encoder) or
sequence-to-sequence type, and whose config nests no other model's config (text, vision, audio, encoder, decoder:
multimodal and encoder-decoder models). Any other model type is refused in one line. The class is built on the meta
device from model.path's config and ``model.config_overrides`` (nothing is loaded), and the derived row takes:

- the decoder layer FSDP wraps (and ``train.compile`` compiles): the classes of the class's ``_no_split_modules``
  that occur in the model;
- LoRA presets from the linear layers (``nn.Linear``, transformers' ``Conv1D``) inside the decoder layers, each
  named by its path inside the layer (``self_attn.q_proj``, ``attention.dense``; under a numbered part such as
  ``experts.0.w1``, what follows the last number; an item of a list by the list's name and its number,
  ``experts.0``). ``attn``: the paths with a part named like attention (``attn``,
  ``attention``) or a last part ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``qkv_proj``, ``query``, ``key`` or
  ``value``. ``attn_mlp``: those, and the paths with a part named like an MLP (``mlp``, ``feed_forward``, ``ffn``,
  ``moe``, ``experts``) or a last part ``gate_proj``, ``up_proj``, ``down_proj``, ``gate_up_proj``, ``fc1`` or
  ``fc2``, but not a mixture-of-experts router (a linear layer with one output per expert). ``all_linear``: the last
  name (an item of a list: ``experts.0``) of every linear layer of the model except the output head (a name the head
  shares is left out). A preset
  that finds nothing is left out (a recipe that asks for it is refused in one line);
- capabilities, conservatively: ``generation`` where the class generates and ``gradient_checkpointing`` where it
  declares support; never ``packing``, ``flex_attention`` or ``preference`` (task dpo and reward), which a row
  claims once it is tested;
- the forward's inputs: input_ids, attention_mask, and position_ids where its forward takes them;
- no named output head: the loss is computed from the model's logits (a family may scale or cap its logits after
  the head, as Cohere's ``logit_scale`` does), at the memory cost of the full logits.

A derived row is kept apart from the table (``finetune.registry.DERIVED``) and derived again by every process that
reads the recipe, from the same config; each command says once, on stderr, that the family is untested, how to add
a row, and where this table is.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from finetune import registry
from finetune.config.schema import ModelConfig
from finetune.errors import ConfigError
from finetune.registry import SupportedModel

TABLE = "docs/reference/models.md"  # the generated table of tested families (the docs' Reference > Model families)
HOW_TO_ADD = ("model.plugin naming a module that calls finetune.registry.register(SupportedModel(...)) "
              "(docs/architecture.md)")
SAID_ENV = "FINETUNE_DERIVED_SAID"  # the model types this command said its line for (the processes it starts inherit)

# the parts of a decoder layer's linear paths, and the leaves, that make them attention or MLP projections
ATTENTION_PART = re.compile(r"attn|attention", re.IGNORECASE)
ATTENTION_LEAF = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query", "key", "value"})
MLP_PART = re.compile(r"mlp|feed_forward|ffn|moe|experts", re.IGNORECASE)
MLP_LEAF = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2"})
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
NESTED_MODEL = re.compile(r"text|vision|audio|encoder|decoder|speech|image|video")  # a sub-config of another model


def resolve(model: ModelConfig) -> None:
    """Set ``model.type`` when the recipe leaves it out, and derive the row of a family without one (see the module
    docstring); a ConfigError line when the type cannot be found. A ``model.type`` that is a row of the table: nothing
    to do (a derived one is derived again: from this recipe's model and overrides)."""
    if model.type is not None and model.type in registry.SUPPORTED_MODELS:
        return
    if model.type is None:
        model_type = config_model_type(model.path)
        row = table_row(model_type)
        model.type = row.name if row is not None else derive(model, model_type).name
        return
    if not model.path or "://" in model.path:  # nothing to read the type from: get_model says what is known
        return
    try:
        model_type = config_model_type(model.path)
    except ConfigError:
        if local_folder(model.path) is None:  # a hub repository it cannot read: get_model says the type is unknown
            return
        raise  # a folder that is missing or holds no config: said beside get_model's line
    if model_type == model.type and table_row(model_type) is None:
        derive(model, model_type)


def table_row(model_type: str) -> SupportedModel | None:
    """The row of the table for a config's ``model_type``: of the rows that list it, a row that is not a debug row,
    then the one named like it, then the first in the table; None when no row lists it."""
    fits = [row for row in registry.SUPPORTED_MODELS.values() if model_type in row.model_types]
    return min(fits, key=lambda row: (row.debug_build, row.name != model_type), default=None)


def local_folder(path: str) -> Path | None:
    """``path`` as a local folder to read, or None where it names a hub repository (``org/name``, not on disk) or a
    ``pkg://`` package. A path that looks local but does not exist is returned (reading it says it is missing)."""
    if "://" in path:
        return None
    folder = Path(path).expanduser()
    looks_local = folder.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1
    return folder if folder.exists() or looks_local else None


def config_model_type(path: str | None) -> str:
    """The ``model_type`` of ``path``'s config.json (a local folder or a hub repository); one ConfigError line naming
    the key and the fix when there is none to read."""
    if path is None:
        raise ConfigError("model.type: not set, and model.path is null (nothing to read the model type from); set "
                          "model.type to a row of `finetune models` (tiny-llama builds a debug model), or model.path")
    if path.startswith("pkg://"):
        raise ConfigError(f"model.type: not set; finetune reads it from the config.json of a folder or a hub "
                          f"repository, not of a package ({path}); set model.type (a row of `finetune models`)")
    folder = local_folder(path)
    if folder is not None:
        if not folder.exists():
            raise ConfigError(f"model.path: folder not found: {path}")
        if not folder.is_dir():
            raise ConfigError(f"model.path: {path} is a file; give the model folder (config.json + weights)")
        config = folder / "config.json"
        if not config.is_file():
            raise ConfigError(f"model.path: {path} has no config.json to read the model type from; give a Hugging "
                              "Face model folder, or set model.type (a row of `finetune models`)")
    else:
        config = _hub_config(path)
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"model.path: {config} cannot be read ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                          "fix it, or set model.type") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise ConfigError(f"model.path: {config} has no model_type; it is not a Hugging Face model config (set "
                          "model.type for a model of a row that reads it)")
    return data["model_type"]


def _hub_config(repo: str) -> Path:
    """The config.json of hub repository ``repo``: from the hub cache (offline), else fetched alone."""
    from huggingface_hub import hf_hub_download  # lazy: heavy

    try:
        return Path(hf_hub_download(repo, "config.json"))
    except Exception as exc:  # not found, gated, offline without it in the cache: its first line says which
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"model.path: cannot read config.json of the hub repository {repo} to learn the model "
                          f"type ({type(exc).__name__}: {first}); check the name (offline: download it first), or "
                          "set model.type") from None


def derive(model: ModelConfig, model_type: str) -> SupportedModel:
    """The row of a causal LM family that has no row, derived from transformers' class (module docstring), kept in
    :data:`finetune.registry.DERIVED` under the model type's name and said once (:func:`say_untested`); one
    ConfigError line when the family cannot be derived."""
    import torch  # lazy: heavy
    import transformers  # lazy: heavy
    from transformers.models.auto import modeling_auto  # lazy: heavy

    def refused(why: str) -> ConfigError:
        return ConfigError(f"model.type: {model_type!r} (the model_type of model.path's config.json) has no row in "
                           f"finetune's table, and {why}; set model.type to a row of `finetune models`, or add a row "
                           f"for it: {HOW_TO_ADD}")

    class_name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    seq2seq = {**modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
               **modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES}
    if model_type not in transformers.CONFIG_MAPPING:
        raise refused("transformers does not know it (a model with its own code is not derived)")
    if not isinstance(class_name, str) or not class_name.endswith("ForCausalLM") \
            or model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in seq2seq:
        raise refused("a row is derived only for a causal language model (a transformers *ForCausalLM decoder), "
                      "which it is not")
    where = str(local_folder(model.path or "") or model.path)
    try:
        config = transformers.AutoConfig.from_pretrained(where)
    except Exception as exc:  # a broken config.json: its first line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"model.path: cannot load the model config from {where} ({type(exc).__name__}: "
                          f"{first})") from None
    nested = [name for name in getattr(config, "sub_configs", {}) or {} if NESTED_MODEL.search(name)]
    if nested:
        raise refused(f"its config nests other models' configs ({', '.join(nested)}: a multimodal or "
                      "encoder-decoder model), for which a row is not derived")
    for key, value in model.config_overrides.items():
        setattr(config, key, value)
    cls = getattr(transformers, class_name)
    try:
        with torch.device("meta"):
            built = cls(config)
    except Exception as exc:  # a config the class cannot build (an override out of range): its first line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"model.path: transformers' {class_name} cannot be built from the config of {where} "
                          f"(with model.config_overrides) ({type(exc).__name__}: {first})") from None
    row = derived_row(model_type, cls, config, built)
    problem = registry.row_problem(row)
    if problem:  # a class this derivation does not understand: refused rather than guessed
        raise refused(f"the row derived for it is not valid ({problem})")
    registry.DERIVED[row.name] = row
    say_untested(row, class_name)
    return row


def derived_row(model_type: str, cls: Any, config: Any, model: Any) -> SupportedModel:
    """The row of ``model`` (built from ``config`` by transformers' ``cls``); a ConfigError when its class names no
    decoder layer the model holds."""
    present = {type(module).__name__ for module in model.modules()}
    wrap = [name for name in (getattr(cls, "_no_split_modules", None) or []) if name in present]
    if not wrap:
        raise ConfigError(f"model.type: {model_type!r} has no row in finetune's table, and its transformers class "
                          f"{cls.__name__} names no decoder layer it holds (_no_split_modules: "
                          f"{getattr(cls, '_no_split_modules', None)}), which FSDP would wrap; add a row for it: "
                          f"{HOW_TO_ADD}")
    capabilities = {"generation"} if cls.can_generate() else set()
    if getattr(cls, "supports_gradient_checkpointing", False):
        capabilities.add("gradient_checkpointing")
    takes = inspect.signature(cls.forward).parameters
    inputs = ("input_ids", "attention_mask", *(("position_ids",) if "position_ids" in takes else ()))
    return SupportedModel(
        name=model_type, task="causal_lm", auto_class="AutoModelForCausalLM", config_class=type(config).__name__,
        decoder_layer=wrap[0], extra_wrap=tuple(wrap[1:]), tiny_config={},
        lora_targets=lora_presets(model, set(wrap), config), capabilities=frozenset(capabilities),
        model_inputs=inputs, model_types=(model_type,), output_head=None,
        description=f"derived from transformers' {cls.__name__} (untested: no row in the table)",
    )


def _is_linear(module: Any) -> bool:
    """A layer LoRA adapts: ``nn.Linear`` (and its subclasses) or transformers' ``Conv1D`` (GPT-2 style)."""
    import torch  # lazy: heavy

    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def lora_presets(model: Any, layers: set[str], config: Any) -> dict[str, tuple[str, ...]]:
    """The LoRA presets of ``model``, whose decoder layers are the classes ``layers`` (the rules in the module
    docstring), each a tuple of module-name suffixes in the order the model holds them."""
    experts = {value for key in EXPERT_COUNTS if isinstance(value := getattr(config, key, None), int) and value > 1}
    attention: dict[str, None] = {}
    mlp: dict[str, None] = {}
    for layer in (module for module in model.modules() if type(module).__name__ in layers):
        for path, module in layer.named_modules():
            if not path or not _is_linear(module):
                continue
            parts = path.split(".")
            numbered = [i for i, part in enumerate(parts[:-1]) if part.isdigit()]
            suffix = _last_name(path) if parts[-1].isdigit() else ".".join(parts[numbered[-1] + 1:] if numbered
                                                                          else parts)
            leaf = parts[-1]
            if any(ATTENTION_PART.search(part) for part in parts[:-1]) or ATTENTION_PART.search(leaf) \
                    or leaf in ATTENTION_LEAF:
                attention[suffix] = None
            elif (any(MLP_PART.search(part) for part in parts) or leaf in MLP_LEAF) \
                    and getattr(module, "out_features", None) not in experts:  # a router: one output per expert
                mlp[suffix] = None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_names = {_last_name(path) for path, module in model.named_modules() if module is head}
    every = dict.fromkeys(_last_name(path) for path, module in model.named_modules()
                          if path and _is_linear(module) and module is not head)
    presets = {"attn": tuple(attention), "attn_mlp": (*attention, *mlp),
               "all_linear": tuple(name for name in every if name not in head_names)}
    return {name: targets for name, targets in presets.items() if targets}


def _last_name(path: str) -> str:
    """A module's last name as a preset writes it: ``q_proj``; an item of a list with its list's name,
    ``experts.0`` (a bare number would also name every decoder layer, ``layers.0``)."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def say_untested(row: SupportedModel, class_name: str) -> None:
    """One line on stderr, once per command (a process this command starts inherits :data:`SAID_ENV` and says
    nothing): the family is untested, what its row does not claim, how to add a row, where the table is."""
    said = os.environ.get(SAID_ENV, "").split(",")
    if row.name in said:
        return
    os.environ[SAID_ENV] = ",".join(filter(None, [*said, row.name]))
    print(f"warning: model.type: {row.name} has no row in finetune's table of tested model families ({TABLE}); it "
          f"trains with a row derived from transformers' {class_name}, untested (LoRA presets from its linear layers' "
          f"names; no packing, flex attention, dpo or reward). To add a row: {HOW_TO_ADD}", file=sys.stderr)
