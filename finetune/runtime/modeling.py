"""Build the model and tokenizer a recipe names, through its SupportedModel row.

``model.path`` may be a hub id, a local folder, or ``pkg://<module>[/sub/path]``: a Python package that ships
weights (its ``get_model_path()`` when it has one, else its folder). A ``debug_build`` row with a null path
builds its tiny config and the tokenizer bundled in ``finetune/assets`` (no download). A custom row (a ``factory``,
see :class:`finetune.registry.SupportedModel`) is built by its own function and saved as a plain state dict
(:data:`CUSTOM_WEIGHTS`); its forward may return bare logits, which :func:`build_custom` turns into an output with
``.logits`` in this one place, so every caller (tasks, probes, exports) reads ``.logits`` alike.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
import re
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.modeling_outputs import CausalLMOutput

from finetune.backends import full_numel
from finetune.config import chat_templates
from finetune.config.schema import ModelConfig
from finetune.data.vision import ImageInputs
from finetune.errors import ConfigError, FinetuneError
from finetune.registry import (
    CUSTOM_WEIGHTS,
    ROW_TASKS,
    SupportedModel,
    model_type_problem,
    resolve_factory,
    user_code,
)

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # finetune/assets
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions")  # learned absolute positions (BERT, GPT-2, OPT)
# transformers' methods that accept or refuse an attention implementation while a model is built: an exception
# raised inside one of them is a refusal of model.attn_implementation, not a problem of the weights
ATTENTION_CHECKS = frozenset({"_check_and_adjust_attn_implementation", "get_correct_attn_implementation",
                              "_flash_attn_can_dispatch", "_flash_attn_import_error", "_sdpa_can_dispatch",
                              "set_attn_implementation"})
BAR_DELAY_S = 5.0  # transformers' own bars (loading weights, writing shards) show only for work longer than this


def _delayed_bar(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """transformers' progress bars appear only once the work has lasted ``BAR_DELAY_S`` seconds (tqdm's
    ``delay``): loading or saving a large model still shows its progress, the sub-second load or export of a small
    one prints nothing. Hub downloads use huggingface_hub's own bars, which this does not touch."""
    return factory(*args, **{"delay": BAR_DELAY_S, **kwargs})


def _install_bar_hook() -> None:
    """Install :func:`_delayed_bar` as transformers' tqdm hook, unless something else installed one first."""
    previous = transformers.utils.logging.set_tqdm_hook(_delayed_bar)
    if previous is not None:
        transformers.utils.logging.set_tqdm_hook(previous)


_install_bar_hook()  # every process that builds or saves a model imports this module first


def resolve_model_path(path: str) -> str:
    """Turn ``pkg://module[/sub]`` into a folder; other values pass through (hub id or local folder)."""
    if not path.startswith("pkg://"):
        return path
    module_name, _, sub = path.removeprefix("pkg://").partition("/")
    if importlib.util.find_spec(module_name) is None:
        raise ConfigError(f"model.path: package {module_name!r} is not installed")
    with loading("package", module_name), user_code(f"model.path: package {module_name!r}", ConfigError,
                                                    "fix the package"):  # its import and get_model_path run its code
        module = importlib.import_module(module_name)
        root = Path(module.get_model_path()) if hasattr(module, "get_model_path") and not sub else \
            Path(module.__file__).parent  # type: ignore[arg-type]
    return str(root / sub) if sub else str(root)


@contextlib.contextmanager
def loading(what: str, where: str, key: str = "model.path") -> Iterator[None]:
    """Turn whatever loading ``what`` from ``where`` raises (missing or broken files, a hub id offline, code that
    needs trust_remote_code, corrupt weights) into one ConfigError line naming ``key`` and the folder."""
    try:
        yield
    except (FinetuneError, MemoryError):
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:240]
        hint = ("; pass --trust-remote-code (or set model.trust_remote_code) only if you trust its code"
                if "trust_remote_code" in str(exc) else "")
        raise ConfigError(f"{key}: cannot load the {what} from {where} ({type(exc).__name__}: {first}){hint}") \
            from exc


def flash_attn_installed() -> bool:
    """Whether the flash_attn package can be imported (looked up, not imported: importing loads CUDA kernels)."""
    return importlib.util.find_spec("flash_attn") is not None


def check_attention(cfg: ModelConfig) -> None:
    """Refuse, in one line, a ``model.attn_implementation`` this machine cannot run, before anything is built.

    The recipe validator already refuses flash_attention_2 without flash_attn and in fp32 without autocast; the
    CUDA device can only be checked where the model runs (flash-attn has no CPU kernels)."""
    if cfg.attn_implementation != "flash_attention_2":
        return
    if not flash_attn_installed():
        raise ConfigError("model.attn_implementation: flash_attention_2 needs the flash_attn package, which is not "
                          "installed; pip install flash-attn on a CUDA machine, or use model.attn_implementation=sdpa")
    if not torch.cuda.is_available():
        raise ConfigError("model.attn_implementation: flash_attention_2 needs a CUDA device and none is available "
                          "here; use model.attn_implementation=sdpa (or null) on this machine")


@contextlib.contextmanager
def attention_support(cfg: ModelConfig, row: SupportedModel) -> Iterator[None]:
    """Turn transformers' refusal of ``model.attn_implementation`` for this model class (it raises ValueError or
    ImportError from its attention checks while the model is built) into one ConfigError line naming the key."""
    try:
        yield
    except (ValueError, ImportError) as exc:
        refused = any(frame.f_code.co_name in ATTENTION_CHECKS for frame, _ in traceback.walk_tb(exc.__traceback__))
        if cfg.attn_implementation is None or not refused:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        sentence = re.split(r"(?<=\.)\s", first, maxsplit=1)[0][:240]  # transformers' first sentence says why
        raise ConfigError(f"model.attn_implementation: {row.name} cannot use {cfg.attn_implementation} "
                          f"({sentence}); choose another model.attn_implementation or null (the model's default)") \
            from exc


def build_tokenizer(cfg: ModelConfig, row: SupportedModel, source: str | None = None) -> Any:
    """The tokenizer of ``source`` (an exported model), else the model's, else the row's bundled one. The model's
    gets ``model.chat_template`` when the recipe sets one (:func:`use_chat_template`), and then
    ``model.chat_template_kwargs`` (:func:`use_template_arguments`); an export's tokenizer already holds the
    template its run trained with (the recipe's file may have changed or gone since)."""
    where = source or (resolve_model_path(cfg.path) if cfg.path else _row_tokenizer(row))
    with loading("tokenizer", where):
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            where, trust_remote_code=cfg.trust_remote_code)  # safe: the recipe given, or --trust-remote-code
    if source is None and cfg.chat_template is not None:
        use_chat_template(tokenizer, cfg.chat_template)
    if source is None and cfg.chat_template_kwargs:
        use_template_arguments(tokenizer, cfg.chat_template_kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # decoders without a pad token: padding is masked anyway
    if row.image_token is not None:  # kept with the tokenizer: saved beside it (save_tokenizer), read by image_inputs
        tokenizer.image_processor = _image_processor(cfg, row, where)
    return tokenizer


def use_chat_template(tokenizer: Any, value: str) -> None:
    """Give ``tokenizer`` the chat template ``value`` names (``model.chat_template``: a named template or a Jinja
    file), replacing its own. Set on the tokenizer itself, so every render, the tokenized-data cache key, the run's
    tokenizer fingerprint and the export's saved tokenizer hold it. A template Jinja cannot compile is one
    ConfigError line here, not an error on every row."""
    from transformers.utils import chat_template_utils  # heavy: transformers

    text = chat_templates.text_of(value)
    compile_template = getattr(chat_template_utils, "_compile_jinja_template", None)  # private: may move
    try:
        if compile_template is not None:
            compile_template(text)
    except Exception as exc:  # jinja2's TemplateSyntaxError (with its line), or any other refusal
        line = getattr(exc, "lineno", None)
        at = f"line {line}: " if line else ""
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"{chat_templates.KEY}: {value} is not a valid Jinja chat template ({at}{detail})") \
            from None
    tokenizer.chat_template = text


def use_template_arguments(tokenizer: Any, arguments: dict[str, Any]) -> None:
    """Fix ``arguments`` (``model.chat_template_kwargs``) in the tokenizer's chat template (each of its named
    templates), so every render reads them and, as for ``model.chat_template``, the cache key, the fingerprint
    and the export hold them; a tokenizer without a template is one ConfigError line."""
    template = tokenizer.chat_template
    if not template:
        raise ConfigError(f"{chat_templates.ARGUMENTS_KEY}: this model's tokenizer has no chat template to give "
                          f"them to; set {chat_templates.KEY} as well")
    if isinstance(template, dict):
        tokenizer.chat_template = {name: chat_templates.with_arguments(text, arguments)
                                   for name, text in template.items()}
    else:
        tokenizer.chat_template = chat_templates.with_arguments(template, arguments)


def _image_processor(cfg: ModelConfig, row: SupportedModel, where: str) -> Any:
    """A vision-language row's image processor from the tokenizer's folder (``where``). transformers picks its PIL
    backend when torchvision is absent; the processor as a whole (with its video part) is not loaded: that needs
    torchvision."""
    with loading("image processor", where):
        return transformers.AutoImageProcessor.from_pretrained(
            where, trust_remote_code=cfg.trust_remote_code)  # safe: the recipe given, or --trust-remote-code


def image_inputs(tokenizer: Any, row: SupportedModel) -> Any:
    """What vision_chat data needs of a vision-language row (None for other rows): the image processor that
    :func:`build_tokenizer` keeps on the tokenizer, and the id of the row's image placeholder token."""
    if row.image_token is None:
        return None

    vocabulary = tokenizer.get_vocab()
    if row.image_token not in vocabulary:
        raise ConfigError(f"model.path: the tokenizer has no {row.image_token!r} token, which {row.name} writes for "
                          "each image; use the model's own tokenizer")
    return ImageInputs(tokenizer.image_processor, row.image_token, vocabulary[row.image_token])


def save_tokenizer(tokenizer: Any, folder: str | Path) -> None:
    """Write the tokenizer into an export or checkpoint folder, with a vision-language row's image processor
    (``preprocessor_config.json``), so the folder loads as the model's own hub folder does."""
    tokenizer.save_pretrained(str(folder))
    if getattr(tokenizer, "image_processor", None) is not None:
        tokenizer.image_processor.save_pretrained(str(folder))


def _row_tokenizer(row: SupportedModel) -> str:
    """A row's own tokenizer: a bundled asset of that name, else the value itself (a folder or a hub id)."""
    asset = ASSETS / (row.tokenizer or "")
    return str(asset) if row.tokenizer and asset.is_dir() else str(row.tokenizer or asset)


def build_config(cfg: ModelConfig, row: SupportedModel, source: str | None = None,
                 labels: list[str] | None = None) -> Any:
    """The HF config: from ``source``/``model.path`` or the row's tiny config, plus ``model.config_overrides``.
    A custom row has none: what needs one (the meta-device memory plan) is refused in one line."""
    if row.factory is not None:
        raise ConfigError(f"model.type: {row.name} is a custom model (factory {row.factory}) without a Hugging Face "
                          "config, which this needs (finetune plan / --dry-run's memory plan); custom rows support "
                          "run, resume and eval of the run")
    if source or cfg.path:
        where = source or resolve_model_path(cfg.path or "")
        with loading("model config", where):
            config = transformers.AutoConfig.from_pretrained(
                where, trust_remote_code=cfg.trust_remote_code)  # safe: the recipe given, or --trust-remote-code
        problem = model_type_problem(row, getattr(config, "model_type", None), where)
        if problem:
            raise ConfigError(problem)
    else:  # a copy: config classes may change the nested dicts they are given (rope parameters)
        config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    for key, value in cfg.config_overrides.items():
        setattr(config, key, value)
    if labels is not None:
        config.num_labels = len(labels)
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
    if ROW_TASKS[row.task].scores:
        set_reward_head(config, build_tokenizer(cfg, row, source).pad_token_id)
    return config


def set_reward_head(config: Any, pad_id: int) -> None:
    """One output named ``reward``, read at each sequence's last token that is not ``pad_id``.

    transformers' sequence-classification decoders score the rightmost token that differs from
    ``config.pad_token_id``; batches are padded with the tokenizer's pad id (the eos token where the tokenizer has
    none), so the config must hold exactly that id, whatever the pretrained config said. It is saved with the
    export, so ``AutoModelForSequenceClassification.from_pretrained(final/)`` scores what training scored."""
    config.num_labels = 1
    config.id2label, config.label2id = {0: "reward"}, {"reward": 0}
    config.pad_token_id = pad_id


def prefer_attention_kernels() -> None:
    """Keep torch's scaled-dot-product attention off its cuDNN backend, for this process.

    On Hopper GPUs (torch 2.11, H200) ``sdpa`` picks cuDNN, which builds an execution plan for every new shape: about
    2.7 ms of host time per attention call, and a fine-tuning run has a new shape at nearly every step (packed rows,
    padded batches and generation all vary in length). The GPU check's profile of a packed Qwen2.5-0.5B step spent
    1.1 s of host time per step against 0.33 s of GPU time, 38% of it in cuDNN attention. Without cuDNN, sdpa takes
    the flash kernel (no mask) or the memory-efficient one (a mask, as packing's block-diagonal one): same math, no
    plan building. A no-op for CPU kernels."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def build_model(cfg: ModelConfig, row: SupportedModel, *, source: str | None = None,
                labels: list[str] | None = None, quantization: Any = None, empty: bool = False) -> Any:
    """Instantiate the row's auto class: pretrained weights from ``source``/``model.path``, else from config.

    ``quantization`` (QLoRA's 4-bit config) needs pretrained weights. ``model.attn_implementation``, when set, is
    passed to transformers on both paths (null keeps the model's default). A custom row is built by its factory
    (:func:`build_custom`); ``source`` is then its export, whose :data:`CUSTOM_WEIGHTS` are loaded into it.

    ``empty``: the model that ``from_pretrained`` would give without its weights: every parameter and buffer on the
    meta device, built from the folder's config with the same dtype and attention implementation, in eval mode as
    ``from_pretrained`` leaves it. Only config.json (and, with trust_remote_code, the model's code) is read;
    finetune.runtime.materialize fills it from rank 0. What needs weights at load time (a custom row, QLoRA's 4-bit
    placement) has no empty form."""
    if empty and (row.factory is not None or quantization is not None or not (source or cfg.path)):
        raise ValueError("an empty model is built only for pretrained Hugging Face weights without quantization")
    if row.factory is not None:
        if quantization is not None:
            raise ConfigError(f"peft.method=qlora quantizes pretrained weights; {row.name} is a custom model")
        model = build_custom(cfg, row)
        if source:
            load_custom_weights(model, Path(source))
        return model
    check_attention(cfg)
    prefer_attention_kernels()
    auto = getattr(transformers, row.auto_class)
    config = build_config(cfg, row, source, labels)
    keeps_sinks(cfg, row, config)
    dtype = DTYPES[cfg.dtype]
    attention = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    if (source or cfg.path) and not empty:
        where = source or resolve_model_path(cfg.path or "")
        extra: dict[str, Any] = dequantized(config, quantization, where)
        if quantization is not None:  # 4-bit weights are placed at load time and cannot be moved afterwards
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            extra = {"quantization_config": quantization, "device_map": {"": device}}
        with loading("model weights", where), attention_support(cfg, row):
            model = auto.from_pretrained(where, config=config, dtype=dtype, **extra, **attention,
                                         trust_remote_code=cfg.trust_remote_code)  # safe: as above
    else:
        if quantization is not None:
            raise ConfigError("peft.method=qlora quantizes pretrained weights; set model.path")
        place = (("model", source or resolve_model_path(cfg.path or "")) if empty
                 else ("model", "its config (model.config_overrides)", "model.config_overrides"))
        with loading(*place), attention_support(cfg, row), torch.device("meta") if empty else contextlib.nullcontext():
            model = auto.from_config(config, dtype=dtype, **attention,
                                     trust_remote_code=cfg.trust_remote_code)  # safe: as above
        if empty:
            model.eval()  # as from_pretrained leaves a model
    check_softcapped_attention(model, row)
    return model


PREQUANTIZED_TRAINABLE = "mxfp4"  # checkpoint quantizations finetune loads dequantized to model.dtype for training


def quantization_method(config: Any) -> str | None:
    """The ``quant_method`` of a checkpoint's config.json ``quantization_config`` (None: not pre-quantized)."""
    found = getattr(config, "quantization_config", None)
    method = found.get("quant_method") if isinstance(found, dict) else getattr(found, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def prequantized(cfg: ModelConfig) -> str | None:
    """The train.log line of a ``model.path`` checkpoint that :func:`dequantized` loads dequantized (None for any
    other model)."""
    if not cfg.path:
        return None
    where = resolve_model_path(cfg.path)
    with loading("model config", where):
        config = transformers.AutoConfig.from_pretrained(
            where, trust_remote_code=cfg.trust_remote_code)  # safe: the recipe given, or --trust-remote-code
    if quantization_method(config) != PREQUANTIZED_TRAINABLE:
        return None
    return (f"model.path: the checkpoint's {PREQUANTIZED_TRAINABLE.upper()} weights are dequantized to {cfg.dtype} "
            f"for training (the export holds {cfg.dtype} weights)")


def dequantized(config: Any, quantization: Any, where: str) -> dict[str, Any]:
    """How ``from_pretrained`` must load a pre-quantized checkpoint so that it trains: GPT-OSS's hub checkpoints hold
    their experts in MXFP4 (4-bit blocks with shared scales), which no optimizer can update; transformers'
    ``Mxfp4Config(dequantize=True)`` expands them into the model's dtype while loading (and drops the
    quantization_config, so the export is a plain checkpoint in that dtype). Without it, on a GPU with the triton
    kernels, transformers would keep them quantized (and refuse to train). QLoRA's NF4 cannot be layered on those
    weights: one line. Other checkpoints: no extra arguments."""
    method = quantization_method(config)
    if method != PREQUANTIZED_TRAINABLE:
        return {}
    if quantization is not None:
        raise ConfigError(f"peft.method=qlora: {where} holds MXFP4-quantized weights (its config.json "
                          "quantization_config), which finetune dequantizes to model.dtype for training and QLoRA "
                          "cannot quantize again at load; use peft.method=lora")
    return {"quantization_config": transformers.Mxfp4Config(dequantize=True)}


def keeps_sinks(cfg: ModelConfig, row: SupportedModel, config: Any) -> None:
    """Refuse ``model.attn_implementation=flash_attention_2`` for a model with attention sinks (GPT-OSS: a learned
    logit per head that joins every softmax), before any weight is read. transformers hands the sinks to a flash
    kernel only when it takes them (vLLM's FA3, FA4); the flash-attn 2 package has no such argument, and transformers
    then drops them without a word, training another model. Eager keeps them (the model's default), flex attention
    on CUDA. The model is built from ``config`` on the meta device to look (nothing allocated; only for this key)."""
    if cfg.attn_implementation != "flash_attention_2":
        return
    with torch.device("meta"):
        model = getattr(transformers, row.auto_class).from_config(
            config, trust_remote_code=cfg.trust_remote_code)  # safe: the recipe given, or --trust-remote-code
    if any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in model.modules()):
        raise ConfigError(f"model.attn_implementation: flash_attention_2 (the flash-attn 2 package) drops the "
                          f"attention sinks of {row.name}; use eager (or null, the model's default)")


def check_softcapped_attention(model: Any, row: SupportedModel) -> None:
    """Refuse, in one line, sdpa for a model that soft-caps its attention scores (``attn_logit_softcapping``, as
    Gemma 2 does): torch's sdpa cannot, and transformers says so only at the first forward, as a traceback. Gemma 2's
    class refuses sdpa when it is built (:func:`attention_support` words that); a Gemma 3 whose config sets a cap
    builds with sdpa, its default, and is caught here."""
    config = model.config
    cap = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                  "attn_logit_softcapping", None)
    if cap is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        raise ConfigError(f"model.attn_implementation: {row.name} soft-caps its attention scores "
                          f"(attn_logit_softcapping={cap}), which sdpa cannot; set model.attn_implementation to "
                          "eager, flex_attention or flash_attention_2")


def custom_config(cfg: ModelConfig, row: SupportedModel) -> dict[str, Any]:
    """What a custom row's factory gets: its ``tiny_config`` updated with ``model.config_overrides``."""
    return {**row.tiny_config, **cfg.config_overrides}


def build_custom(cfg: ModelConfig, row: SupportedModel) -> torch.nn.Module:
    """A custom row's model: ``factory(config, dtype)``, checked to be a module holding the ``decoder_layer`` class
    FSDP wraps; its forward output always has ``.logits`` (:func:`_logits_output`)."""
    factory = resolve_factory(row)
    with loading("model", f"its factory {row.factory}", key="model.config_overrides"):
        model = factory(custom_config(cfg, row), DTYPES[cfg.dtype])
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model.plugin: the factory {row.factory} of {row.name} returned a "
                          f"{type(model).__name__}, not a torch.nn.Module")
    classes = sorted({type(m).__name__ for m in model.modules()})
    if row.decoder_layer not in classes:
        raise ConfigError(f"model.plugin: SupportedModel {row.name!r} decoder_layer {row.decoder_layer!r} is not a "
                          f"module class of the model its factory builds; its classes: {', '.join(classes)}")
    model.register_forward_hook(functools.partial(_logits_output, row.name))
    return model


def _logits_output(name: str, module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a custom model: bare logits become a ``CausalLMOutput`` (a ModelOutput, which torch's
    pytree and the distributed wrappers traverse); an output with ``.logits`` passes unchanged."""
    if isinstance(output, torch.Tensor):
        return CausalLMOutput(logits=output)
    if not isinstance(getattr(output, "logits", None), torch.Tensor):
        raise ConfigError(f"model.type: the forward of custom model {name} returned a {type(output).__name__}; "
                          "return the logits tensor or an object with .logits")
    return None


def save_custom_weights(state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    """A custom model's export: its whole state dict as :data:`CUSTOM_WEIGHTS` (copies, so tensors that share
    storage save too)."""
    from safetensors.torch import save_file  # lazy: heavy

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().clone().contiguous() for k, v in state_dict.items()}, str(folder / CUSTOM_WEIGHTS))


def load_custom_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load :data:`CUSTOM_WEIGHTS` of an export into a freshly built custom model; every key must fit."""
    from safetensors.torch import load_file  # lazy: heavy

    with loading("model weights", str(folder), key="eval"):
        model.load_state_dict(load_file(str(folder / CUSTOM_WEIGHTS)), strict=True)


def _input_embedding(model: Any) -> torch.nn.Module | None:
    """The token embedding: HF's accessor, else a custom model's first ``nn.Embedding`` that is no position
    table (None when it has none: nothing to check)."""
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings()
    return next((m for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
                 and name.rsplit(".", 1)[-1] not in POSITION_TABLES), None)


def check_fits(model: Any, tokenizer: Any, max_seq_len: int) -> None:
    """Refuse a model that cannot take what the data will feed it, before training fails deep inside a forward pass:
    token ids beyond its embedding, or sequences longer than its absolute position embeddings."""
    embedding = _input_embedding(model)
    rows = getattr(embedding, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        raise ConfigError(f"model: the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} "
                          "rows; use the model's own tokenizer, or raise model.config_overrides.vocab_size")
    config = getattr(model, "config", None)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    hidden, head_dim = getattr(config, "hidden_size", None), getattr(config, "head_dim", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ConfigError(f"model.config_overrides: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}")
    if isinstance(heads, int) and isinstance(hidden, int) and head_dim in (None, hidden // heads) and hidden % heads:
        raise ConfigError(f"model.config_overrides: hidden_size={hidden} is not a multiple of "
                          f"num_attention_heads={heads}")
    absolute = min((m.num_embeddings for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
                    and name.rsplit(".", 1)[-1] in POSITION_TABLES), default=None)
    if absolute is not None and max_seq_len > absolute:
        raise ConfigError(f"data.max_seq_len={max_seq_len} is longer than the {absolute} positions this model can "
                          f"embed; set data.max_seq_len to at most {absolute}")
    trained = position_limit(config)
    if absolute is None and trained is not None and max_seq_len > trained:
        raise ConfigError(f"data.max_seq_len={max_seq_len} is longer than the {trained} positions this model was "
                          f"trained for (max_position_embeddings in its config); set data.max_seq_len to at most "
                          f"{trained}, or extend its context with model.config_overrides (rope_scaling and "
                          "max_position_embeddings)")


def position_limit(config: Any) -> int | None:
    """The positions a rotary model was trained for: ``max_position_embeddings`` of its config (a vision-language
    model's text config), or None where the config names none (a custom row)."""
    for part in (config, getattr(config, "text_config", None)):
        value = getattr(part, "max_position_embeddings", None) if part is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def enable_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in backward (``train.gradient_checkpointing``), with torch's
    non-reentrant checkpoint (stated, so torch does not warn about its default) through the method transformers
    keeps (``gradient_checkpointing_enable`` warns that it will be removed); no KV cache while training."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers releases before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def build_base(cfg: ModelConfig, row: SupportedModel, seed: int, labels: list[str] | None = None,
               quantization: Any = None, empty: bool = False) -> Any:
    """The model a run starts from: seeded first, so a config-built (debug) model is the same one every time -
    in training, in ``finetune eval`` of an adapter and in ``finetune merge``. ``empty``: see :func:`build_model`."""
    from accelerate.utils import set_seed  # lazy: heavy

    set_seed(seed)
    return build_model(cfg, row, labels=labels, quantization=quantization, empty=empty)


@contextlib.contextmanager
def compile_failures(enabled: bool) -> Iterator[None]:
    """With ``train.compile`` on, turn a failed torch.compile into one ConfigError line naming the key.

    torch compiles lazily: a missing or broken C++ compiler, an unsupported Python or an operator inductor cannot
    lower surfaces at the first forward or backward pass (or later, at a recompile for new shapes), deep inside the
    loop. The innermost exception (BackendCompilerFailed wraps the backend's own) is the one that says why."""
    if not enabled:
        yield
        return
    from torch._dynamo.exc import TorchDynamoException  # lazy: heavy
    from torch._inductor import exc as inductor  # lazy: heavy

    try:
        yield
    except (TorchDynamoException, inductor.CppCompileError, inductor.InvalidCxxCompiler,
            inductor.OperatorIssue) as exc:
        cause: BaseException = exc
        while isinstance(getattr(cause, "inner_exception", None), BaseException):
            cause = cause.inner_exception  # type: ignore[attr-defined]
        first = (str(cause).strip().splitlines() or [""])[0][:240]
        raise ConfigError(f"train.compile: torch.compile failed ({type(cause).__name__}: {first}); set "
                          "train.compile=false to train without it") from exc


def compile_model(model: torch.nn.Module, row: SupportedModel) -> int:
    """Compile each of the model's decoder layers (the row's ``decoder_layer`` class) in place for
    ``train.compile``; returns how many.

    Per block, as torchtitan does, not the whole model: every layer runs the same code, so dynamo traces one graph
    that all layers share (their parameters are graph inputs), compile time does not grow with depth, and what
    runs between the layers (embedding, the chunked loss, hooks of the wrappers) stays eager. Shapes follow
    dynamo's default: the first row length compiles a static graph, a second one a graph with the length dynamic,
    which serves every later length; ``data.pack_to_multiple_of`` keeps the lengths few.

    In place (``nn.Module.compile``), not ``torch.compile(layer)``: modules keep their class and the state_dict its
    keys (no ``_orig_mod.`` part), so checkpoints, exports, LoRA adapters and accelerate's unwrap_model see the
    model they always did, and FSDP still finds the layers it wraps by class name. Called after LoRA is applied
    (the adapters are part of the compiled layers) and before accelerate.prepare wraps the model for DDP/FSDP
    (accelerate's own dynamo plugin is not used; DeepSpeed is refused by the recipe validator). The compilation
    itself happens at the first forward pass; :func:`compile_failures` turns its failure into a ConfigError."""
    layers = [module for module in model.modules() if type(module).__name__ == row.decoder_layer]
    if not layers:
        raise ConfigError(f"train.compile: compiles each {row.decoder_layer} (the decoder_layer of {row.name}), but "
                          "the model has none; set train.compile=false")
    try:
        for layer in layers:
            layer.compile()
    except RuntimeError as exc:  # torch.compile refuses up front on a Python version dynamo does not support
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:240]
        raise ConfigError(f"train.compile: torch.compile is not available here ({first}); set "
                          "train.compile=false") from exc
    return len(layers)


def freeze(model: torch.nn.Module, row: SupportedModel, parts: list[str]) -> int:
    """Stop training the ``parts`` (``model.freeze``) of the model: every parameter under one of the module-name
    prefixes the row gives each part gets ``requires_grad=False`` before the optimizer is built. Returns how many
    parameter elements were frozen (whole tensors, :func:`finetune.backends.full_numel`: under ZeRO-3 a model is
    partitioned at birth and ``numel()`` would count nothing); a part that matches none is a ConfigError (the
    row's prefixes do not fit this model)."""
    frozen = 0
    for part in parts:
        prefixes = row.freeze_groups[part]  # validated: a part the row names
        matched = [p for name, p in model.named_parameters() if any(name == x or name.startswith(x + ".")
                                                                   for x in prefixes)]
        if not matched:
            raise ConfigError(f"model.freeze: {part} ({', '.join(prefixes)}) matches no parameter of this "
                              f"{row.name} model; remove it from model.freeze")
        for param in matched:
            param.requires_grad_(False)
            frozen += full_numel(param)
    return frozen
