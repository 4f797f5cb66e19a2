"""The recipe schema: every key a recipe may set, its type and its default.

Defaults live here and nowhere else. Every section forbids unknown keys, so a typo is an error (with a
did-you-mean, see :mod:`finetune.config.validate`) instead of a silently ignored setting. This module imports
no torch: the CLI validates recipes without loading the training stack.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from finetune import objectives
from finetune.config import chat_templates

# One path component that cannot climb out of runs/ or name a hidden or special folder ("", ".", "..", "a/b").
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$"
Beta = Annotated[float, Field(ge=0, lt=1)]


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, values are validated on assignment too, and no
    number may be inf or nan (a non-finite lr or eps trains garbage without failing)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    """Which model to fine-tune and how to load it."""

    type: str | None = Field(
        default=None,
        description="a row of the SupportedModel table (`finetune models`). null: the row whose model_types list the "
        "model_type of model.path's config.json (a non-debug row first); a causal LM whose family has no row trains "
        "with a row derived from its transformers class (untested, said on stderr). The resolved recipe records the "
        "type found",
    )
    path: str | None = Field(
        default=None,
        description="hub id, local folder, or pkg://<module> (a Python package that ships weights); "
        "null builds the row's debug config (tiny-llama)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="the dtype the model's weights are built or loaded in and trained in (autocast is "
        "train.mixed_precision)",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="let transformers run the model folder's or hub repository's own Python code (auto_map); the "
        "--trust-remote-code flag sets it. Only for code you trust",
    )
    plugin: str | None = Field(default=None, description="module that registers extra SupportedModel rows")
    config_overrides: dict[str, int | float | str | bool | None] = Field(
        default_factory=dict,
        description="keys set on the HF model config before building (e.g. attention_dropout: 0.1)",
    )
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager", "flex_attention"] | None = Field(
        default=None,
        description="attention kernel passed to transformers; null: the model's own default (sdpa where supported). "
        "flash_attention_2 needs the flash-attn package, a CUDA device and half precision "
        "(model.dtype bfloat16/float16 or train.mixed_precision bf16/fp16); flex_attention needs a model type with "
        "the flex_attention capability (finetune models)",
    )
    freeze: list[str] = Field(
        default_factory=list,
        description="parts of the model not trained, as the model type names them (vision-language types: vision, "
        "projector, language; e.g. [vision] trains the projector and the language model)",
    )
    chat_template: str | None = Field(
        default=None,
        description="the chat template every chat render uses (training, eval, generate, GRPO prompts), for a "
        "tokenizer that has none or to replace its own: a named template (chatml, or hermes: chatml with tool "
        "calls) or the path of a Jinja file "
        "(relative to the recipe file); it is saved with the export's tokenizer. null: the tokenizer's own",
    )

    chat_template_kwargs: dict[str, StrictBool | StrictInt | StrictFloat | StrictStr] | None = Field(
        default=None,
        description="values the chat template reads, fixed for this model in every render (training, eval, "
        "generate, GRPO prompts) and in the export's template, e.g. {enable_thinking: false} for Qwen3 or Nemotron "
        "answers without reasoning. null: the template's own defaults",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_names(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Each name must be one a template can read and the renderer does not set (one line)."""
        problem = None if value is None else chat_templates.arguments_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        """A name must be one of the named templates (one line listing them); a file is checked by validation."""
        problem = None if value is None else chat_templates.name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("config_overrides", mode="before")
    @classmethod
    def _scalar_overrides(cls, value: object) -> object:
        """One clear line per bad value (a union type would report one line per member type)."""
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, float) and not math.isfinite(item):
                    raise ValueError(f"{key}: {item} is not a finite number")
                if not isinstance(item, int | float | str | bool | None):
                    raise ValueError(f"{key}: must be a number, text, true/false or null, got {type(item).__name__}")
        return value


MESSAGE_KEYS = ("role", "content")  # the message keys a source may rename (finetune.data.mapping)


def mapping_problem(columns: dict[str, str], message_keys: dict[str, str]) -> str | None:
    """What is wrong with a source's ``columns`` / ``message_keys`` on their own, in one line (None: nothing): a
    message key finetune does not read, an empty name, or one column given for two fields."""
    for key in message_keys:
        if key not in MESSAGE_KEYS:
            return f"{key!r} is not a message key finetune reads; map {' and '.join(MESSAGE_KEYS)}"
    for name, value in [*columns.items(), *message_keys.items()]:
        if not name.strip() or not value.strip():
            return f"an empty name in {{{name!r}: {value!r}}}"
    taken = list(columns.values())
    twice = next((value for i, value in enumerate(taken) if value in taken[:i]), None)
    if twice is not None:
        return f"columns gives {twice!r} for two fields; a column holds one field"
    return None


class DataSource(Section):
    """One data set: a local file, glob or folder, or a hub dataset (with its subset and split). A ``data.eval``
    list holds these; its sources are concatenated."""

    path: str = Field(
        description="where the rows are (relative to the recipe file): a jsonl/json/csv/parquet/arrow file, plain or "
        "compressed (.gz, .bz2, .xz, .zst; x.jsonl.gz is JSON lines); a glob of files of one type (data/*.jsonl, "
        "data/train-*.parquet); a folder of data files such as a cloned hub dataset (its splits found in the file "
        "names as datasets finds them); a folder written by datasets' save_to_disk; or a hub dataset name",
    )
    format: str | None = Field(
        default=None, description="this source's format (one of data.format's values); null: data.format",
        json_schema_extra=lambda schema: schema.update(anyOf=[{"enum": list(data_formats())}, {"type": "null"}]),
    )
    subset: str | None = Field(
        default=None, description="a hub dataset's (or a dataset folder's) configuration (subset) name; null: the "
        "dataset's default",
    )
    split: str = Field(
        default="train",
        description="the split to read, as datasets writes it, optionally sliced: train, test, train[:1000], "
        "train[10%:], train[:50%], train[:90%]+validation. A file or a glob is the one split train (slice it to read "
        "part of it); a folder's splits come from its file names (train, test, validation, ...), a saved "
        "DatasetDict's from its sub-folders",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="the source's own column for each field its format reads, where the names differ, e.g. "
        "{messages: conversations} or {text: body}",
    )
    message_keys: dict[str, str] = Field(
        default_factory=dict,
        description="the keys of a message in the source's conversations, where they differ: {role: from, content: "
        "value}; a role value that is no chat role is read as a ShareGPT speaker (human: user, gpt: assistant)",
    )

    @model_validator(mode="after")
    def _mapping(self) -> DataSource:
        """The columns and message keys must make sense on their own (one line: :func:`mapping_problem`)."""
        problem = mapping_problem(self.columns, self.message_keys)
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        """The same formats as data.format, whatever that list holds."""
        if value is not None and value not in data_formats():
            raise ValueError(f"{value!r} is not a format; use one of {', '.join(data_formats())} (or null: "
                             "data.format)")
        return value


class TrainSource(DataSource):
    """One source of a mixed ``data.train``."""

    weight: float = Field(
        default=1.0, gt=0,
        description="multiplies this source's share: each mixture epoch draws round(weight x rows) of its samples "
        "(at least 1); 1 = every row once per epoch, 2 = twice, 0.5 = half of them (the rest next epoch)",
    )


CAUSAL_FORMATS = ("alpaca", "chat", "completion")  # tokenized into the same columns: they mix with each other
SOURCE_TAGS = ("single", "sources")  # how a data.train / data.eval value is told apart: a path, or a list of sources


def _source_kind(value: Any) -> str | None:
    """Which form a data.train / data.eval value has (None: neither, one error line)."""
    if isinstance(value, str):
        return "single"
    if isinstance(value, list):
        return "sources"
    return None


def _sources_of(kind: type[DataSource]) -> Any:
    """The type of data.train (TrainSource) or data.eval (DataSource): a path, or a non-empty list of sources."""
    return Annotated[
        # type: ignore[valid-type]
        Annotated[str, Tag("single")] | Annotated[list[kind], Field(min_length=1), Tag("sources")],
        Discriminator(_source_kind, custom_error_type="data_sources",
                      custom_error_message="must be a path (file or hub name) or a list of sources {path, ...}"),
    ]


DataFormat = Literal["alpaca", "chat", "completion", "classification", "preference", "vision_chat", "prompt"]


class DataConfig(Section):
    """Training and evaluation data."""

    format: DataFormat | None = Field(
        default=None,
        description="null: the task's own (preference for dpo / reward, prompt for grpo, the model row's when it "
        "takes one), else each source's read from its columns (the rule: Data formats in the docs). "
        "alpaca | chat | completion (causal LM), classification, preference (pairs for task dpo / "
        "reward: {prompt, chosen, rejected} strings or {chosen, rejected} message lists), vision_chat "
        "({messages} whose user turns may hold image parts {type: image, image: path relative to the data file} "
        "beside {type: text, text}; vision-language model types), or prompt (task grpo: {prompt: text} or "
        "{messages} without the final assistant turn; every other field of a row, e.g. answer, goes to the reward "
        "functions)",
    )
    train: _sources_of(TrainSource) = Field(  # type: ignore[valid-type]
        description="a data file (relative to the recipe; compressed too), a glob of files, a folder of data files or "
        "a save_to_disk folder, or a hub dataset name (see the sources' path); or a mixture: a "
        "list of sources {path, weight: 1.0, format: data.format, subset: null, split: train} (a single mapping is "
        "a list of one). A mixture epoch draws round(weight x rows) samples of each source (at least 1), each "
        "source from its own seeded permutations (wrapping for weight > 1), then shuffles the whole epoch; "
        "the data cursor stays one integer and resume stays exact",
    )
    eval: _sources_of(DataSource) | None = Field(  # type: ignore[valid-type]
        default=None,
        description="file, glob, folder or hub dataset name, or a list of sources {path, format, subset, split} "
        "(concatenated)",
    )
    max_seq_len: int = Field(
        default=256, gt=1, description="tokens per sample at most; a longer sample is handled as data.overlong says",
    )
    overlong: Literal["truncate", "drop"] = Field(
        default="truncate", description="what to do with samples longer than max_seq_len"
    )
    shuffle: bool = Field(
        default=True, description="shuffle the training samples each epoch with a permutation seeded by train.seed; "
        "false: file order",
    )
    packing: bool = Field(
        default=False,
        description="padding-free packing: each training micro-batch's samples are concatenated into one row with "
        "position ids restarting per sample (no attention across samples); the batch stays a number of samples",
    )
    pack_to_multiple_of: int | None = Field(
        default=None, ge=1,
        description="fixed-length packing (needs data.packing): each packed row is padded up to a multiple of this "
        "many tokens with a padding segment that trains nothing, so torch.compile (train.compile) sees at most "
        "ceil(micro_batch_size x max_seq_len / this) row lengths and compiles each once; null: rows as long as "
        "their samples",
    )
    train_on_prompt: bool = Field(
        default=False, description="false: the prompt's tokens are masked from the loss, only the answer is trained; "
        "true: every token is trained",
    )
    train_turns: Literal["all", "last"] = Field(
        default="all", description="chat rows: which assistant turns are trained: all, or the last only (a message's "
        "own train: true / false overrides this for it)",
    )
    train_reasoning: bool = Field(
        default=True, description="chat rows: whether an assistant turn's reasoning trace (reasoning_content / "
        "thinking, where the template renders it) is trained; false: the rest of the turn only",
    )
    add_bos: Literal["auto", "always"] = Field(
        default="auto",
        description="the special tokens before a sample's or prompt's tokens. auto: as the model is served: a chat "
        "(chat, chat preference pairs, vision_chat, chat prompts) is exactly apply_chat_template(..., "
        "tokenize=True) (the template writes its bos or none; nothing is added), raw text (alpaca, completion, "
        "string pairs, text prompts) gets what the tokenizer's own call puts first (not twice). always: the "
        "tokenizer's bos token first unless the text starts with it, for every kind (finetune before this key; "
        "runs trained then keep it)",
    )
    num_workers: int | None = Field(
        default=None, ge=0, le=64,
        description="DataLoader worker processes per rank that collate batches ahead of the step; null: 2 on CUDA "
        "(with pinned memory and non-blocking copies), 0 on the CPU, where a worker competes with training for the "
        "cores. The data order, and so exact resume, does not depend on it",
    )
    labels: list[str] | None = Field(
        default=None, min_length=2,
        description="classification label names in id order (at least two); null = sorted names found in train",
    )
    streaming: bool = Field(
        default=False,
        description="read data.train as a stream, tokenized on the fly while training (nothing cached; for corpora "
        "larger than the disk cache): jsonl from a byte offset, parquet/csv/json/arrow files and hub datasets through "
        "datasets' streaming (whole: no folders, globs, saved folders, compressed files or sliced splits). Needs "
        "train.max_steps (a stream has no epoch length). Sources mix by weight with a "
        "seeded choice per sample; data.packing packs samples greedily into rows of at most max_seq_len tokens (the "
        "global batch then counts packed rows); data.shuffle uses data.shuffle_buffer. The exact cursor (reader "
        "positions, buffers, choices) is saved in every checkpoint, so a resume continues at the next unseen sample. "
        "data.eval is not streamed. Tokenizing runs in the training process, or with data.num_workers > 0 in one "
        "worker process that reads ahead (the saved cursor stays exact)",
    )
    shuffle_buffer: int = Field(
        default=1000, ge=1, le=1_000_000,
        description="data.streaming with data.shuffle: samples each source holds in a seeded shuffle buffer (every "
        "draw takes a random one and refills its slot from the stream); its contents are saved in every checkpoint, "
        "so resume is exact. Larger mixes further, costs memory and checkpoint size",
    )
    num_proc: int | None = Field(
        default=None, ge=1, le=256,
        description="processes that tokenize the data (each a contiguous shard, in batches); null: the cores this "
        "process may use, at most 8, and one per 5,000 rows (a small file is tokenized in one process). The "
        "tokenized data, the cache key and every bad-row error are the same whatever the number",
    )

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _one_source(cls, value: Any) -> Any:
        """A single mapping ``{path, subset, split, ...}`` is a list of one source."""
        return [value] if isinstance(value, dict | DataSource) else value

    @field_validator("train", "eval")
    @classmethod
    def _one_task(cls, value: Any, info: ValidationInfo) -> Any:
        """Sources of different tasks tokenize into different columns, so they cannot be mixed: the causal LM
        formats mix with each other, any other format (classification) only with itself. ``format`` is validated
        before ``train`` and ``eval`` (field order), so the default format is known."""
        default = info.data.get("format")
        if not isinstance(value, list) or default is None:
            return value
        formats = [source.format or default for source in value]
        if len({"causal LM" if fmt in CAUSAL_FORMATS else fmt for fmt in formats}) > 1:
            listed = ", ".join(f"[{i}] {fmt}" for i, fmt in enumerate(formats))
            raise ValueError(f"sources of different tasks cannot be mixed ({listed}); {', '.join(CAUSAL_FORMATS)} "
                             "mix with each other, any other format only with itself")
        return value

    @model_validator(mode="after")
    def _stream_formats(self) -> DataConfig:
        """A stream is never read whole: classification label names must be given, not found in it."""
        if self.streaming and any(s.columns or s.message_keys for s in self.train_sources()):
            raise ValueError("data.streaming reads each source as it is written; a source's columns or message_keys "
                             "need data.streaming: false (or write the file with finetune's names)")
        if self.streaming and self.labels is None and any(s.format == "classification" for s in self.train_sources()):
            raise ValueError("data.streaming with data.format classification needs data.labels (the label names "
                             "cannot be collected from a stream before training)")
        return self

    def train_sources(self) -> list[TrainSource]:
        """data.train as sources, each with its format filled in (a path is one source of weight 1)."""
        sources = [TrainSource(path=self.train)] if isinstance(self.train, str) else self.train
        return [s.model_copy(update={"format": s.format or self.format}) for s in sources]

    def eval_sources(self) -> list[DataSource]:
        """data.eval as sources, each with its format filled in (none without an eval set)."""
        if self.eval is None:
            return []
        sources = [DataSource(path=self.eval)] if isinstance(self.eval, str) else self.eval
        return [s.model_copy(update={"format": s.format or self.format}) for s in sources]


# Keys added after runs were trained without them, with the value such a run was trained with when that differs from
# the default. A recipe finetune wrote (a run's, a checkpoint's or an export's recipe.resolved.yaml) that lacks one
# is read with this value (finetune.config.compose.compose_stored), so an older run resumes, evaluates and generates
# as it trained; a recipe a user writes gets the default.
STORED_DEFAULTS: dict[str, Any] = {"data.add_bos": "always", "train.dropout": True}


def data_formats() -> tuple[str, ...]:
    """The formats data.format accepts (a source's format accepts the same)."""
    return get_args(DataFormat)


class TrainConfig(Section):
    """Batch arithmetic, length of training, precision."""

    seed: int = Field(
        default=42, ge=0, lt=2**32,
        description="seeds the data order, the initialisation of new weights (heads, LoRA), dropout and sampling",
    )
    micro_batch_size: int = Field(
        default=8, ge=1, description="samples per forward pass on each process (task grpo: prompts, each giving "
                                     "grpo.group_size completions)",
    )
    global_batch_size: int = Field(
        default=32, ge=1, description="samples per optimizer step over all processes (task grpo: prompts, each "
                                      "giving grpo.group_size completions)",
    )
    max_steps: int | None = Field(
        default=None, ge=1, description="optimizer steps to train; set exactly one of train.max_steps or train.epochs",
    )
    epochs: float | None = Field(
        default=None, gt=0,
        description="passes over the training set (mixture epochs for a list of sources; may be fractional), "
        "turned into optimizer steps; set exactly one of train.max_steps or train.epochs",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        default="no", description="autocast compute precision over the weights of model.dtype; fp16 adds dynamic "
        "loss scaling",
    )
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="the gradients' total norm is clipped to this before each optimizer step; "
        "null: no clipping (the norm is still logged)",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute each decoder layer's activations in backward: less activation "
        "memory for about one more forward pass of compute",
    )
    dropout: bool | None = Field(
        default=None,
        description="the model's dropout while training: true keeps every rate its config (and peft.dropout) sets; "
        "false sets them all to 0 (dropout modules, attention dropout, LoRA dropout; the exported config keeps "
        "them). null: false for task dpo, reward and grpo (they compare the policy with a reference, or two "
        "samples, scored without dropout: as the DPO paper's code and TRL), true otherwise. The resolved recipe "
        "and finetune plan show the value used",
    )
    max_nonfinite_steps: int = Field(
        default=3, ge=1,
        description="a step with a non-finite loss or gradient norm is skipped; this many in a row stop the run",
    )
    compile: bool = Field(
        default=False,
        description="compile each decoder layer in place with torch.compile (nn.Module.compile, before DDP/FSDP "
        "wrap it: parameter names, checkpoints and exports are unchanged; not with DeepSpeed); the first steps are "
        "slower while it compiles. With data.pack_to_multiple_of the layers compile for static shapes, once per row "
        "length",
    )
    peak_tflops: float | None = Field(
        default=None, gt=0,
        description="this device's peak dense TFLOP/s, for the logged mfu; null: looked up by GPU name (bf16 dense "
        "tensor-core figures of common GPUs, finetune.runtime.flops.PEAK_BF16_TFLOPS); on the CPU or an unknown "
        "GPU the mfu is then omitted, never guessed",
    )

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of train.max_steps or train.epochs (the other to null)")
        return self


class OptimConfig(Section):
    """The optimizer."""

    name: Literal["adamw", "sgd"] = Field(default="adamw", description="the optimizer: torch's AdamW or SGD")
    lr: float = Field(default=3.0e-4, gt=0, description="peak learning rate (the scheduler scales it per step)")
    weight_decay: float = Field(default=0.0, ge=0, description="decoupled weight decay (adamw), L2 (sgd)")
    betas: tuple[Beta, Beta] = Field(default=(0.9, 0.999), description="adamw only: the moment decay rates")
    eps: float = Field(default=1.0e-8, gt=0, description="adamw only: added to the denominator")
    momentum: float = Field(default=0.0, ge=0, description="sgd only")
    fused: bool | None = Field(
        default=None,
        description="adamw only: torch's fused AdamW kernel. null: fused where torch has it for the device (CUDA, and "
        "the CPU since torch 2.4; as the transformers Trainer's default adamw_torch_fused), plain elsewhere; true: "
        "require it (an error where the device has none); false: never",
    )

    @field_validator("fused")
    @classmethod
    def _fused_needs_adamw(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        """``name`` is validated before ``fused`` (field order), so the line can name this key."""
        name = info.data.get("name")
        if value and name not in (None, "adamw"):  # None: name itself is invalid and reported
            raise ValueError(f"true needs optim.name=adamw (the fused kernel used here is AdamW's), got {name}; "
                             "set optim.fused to null or false")
        return value


class SchedulerConfig(Section):
    """Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr_ratio x lr."""

    name: Literal["constant", "linear", "cosine"] = Field(
        default="cosine", description="the shape after warmup: constant, or a linear or cosine decay to the last step",
    )
    warmup_steps: int = Field(default=0, ge=0, description="optimizer steps of linear warmup from lr/warmup_steps")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="the decay ends at this fraction of optim.lr")


class EvalConfig(Section):
    """Periodic evaluation."""

    every_steps: int | None = Field(default=None, ge=1, description="null: evaluate only at the end")
    at_start: bool = Field(default=False, description="also evaluate before the first step")
    metrics: list[str] = Field(
        default_factory=list,
        description="causal_lm: token_accuracy, exact_match, tool_calls (the generated calls of rows whose last turn "
        "calls tools, compared as data); classification: accuracy; task dpo / reward: preference_accuracy. "
        "Loss/perplexity always.",
    )
    max_new_tokens: int = Field(default=16, ge=1, description="exact_match, tool_calls: greedy tokens generated")
    batch_size: int = Field(default=16, ge=1, description="samples per forward pass during evaluation, per process")


class DPOConfig(Section):
    """Direct preference optimization (``task: dpo``): the policy learns from pairs against the initial model."""

    beta: float = Field(default=0.1, gt=0, description="strength of the pull towards the reference (initial) model")
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5,
        description="conservative DPO: the assumed fraction of pairs whose preference is flipped (sigmoid loss only)",
    )
    loss: Literal["sigmoid", "ipo"] = Field(
        default="sigmoid",
        description="sigmoid: -log sigmoid(beta * h) over summed answer log-probs; ipo: (h - 1/(2 beta))^2 over "
        "per-token averaged log-probs (h: policy minus reference log-ratio of chosen over rejected)",
    )

    @field_validator("loss")
    @classmethod
    def _smoothing_is_sigmoid_only(cls, value: str, info: ValidationInfo) -> str:
        """``label_smoothing`` is validated before ``loss`` (field order), so the line can name both keys."""
        smoothing = info.data.get("label_smoothing")
        if value != "sigmoid" and smoothing:
            raise ValueError(f"{value} takes no label smoothing, but dpo.label_smoothing={smoothing:g}; set "
                             "dpo.label_smoothing=0 or use dpo.loss=sigmoid")
        return value


FUNCTION_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
REWARD_KINDS = ("exact_match", "regex", "function", "reward_model")  # the keys that say what a reward item is


class RewardSpec(Section):
    """One reward function of ``task: grpo``: exactly one of ``exact_match: true``, ``regex``, ``function`` or
    ``reward_model``, with its weight in the total and the name its metrics are logged under."""

    exact_match: Literal[True] | None = Field(
        default=None, description="true: 1.0 when the completion, stripped, equals the row's answer field as text "
                                  "(stripped), else 0.0",
    )
    regex: str | None = Field(
        default=None, description="a Python regular expression: 1.0 when re.search(pattern, completion) finds it, "
                                  "else 0.0 (a format reward)",
    )
    function: str | None = Field(
        default=None,
        description="a plugin 'pkg.module:function', called as function(prompts, completions, rows) -> one float per "
        "completion (rows: each prompt row's other fields); imported only for a recipe given on the command line "
        "(or with --trust-remote-code for a stored run)",
    )
    reward_model: str | None = Field(
        default=None,
        description="a task: reward run's final/ folder (or its run directory): its score of prompt + completion "
        "(weights only, never remote code)",
    )
    weight: float = Field(default=1.0, description="this reward's factor in the total reward (its metric is "
                                                   "logged unweighted)")
    name: str | None = Field(
        default=None, description="the metric name (rewards/<name>); null: exact_match, regex, the function's "
                                  "name, or reward_model. Names must be unique",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSpec:
        """Exactly one kind per item (an item of two kinds would be two rewards under one weight)."""
        given = [kind for kind in REWARD_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            what = f"has {' and '.join(given)}" if given else "names none"
            raise ValueError(f"a reward item needs exactly one of {', '.join(REWARD_KINDS)}; this one {what} "
                             "(split it into one item per reward)")
        return self

    @field_validator("exact_match", mode="before")
    @classmethod
    def _true_only(cls, value: Any) -> Any:
        """``exact_match: false`` would be an item naming no reward: say so rather than "should be True"."""
        if value is False:
            raise ValueError("false names no reward; write exact_match: true, or remove the item")
        return value

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"{value!r} is not a regular expression ({exc})") from None
        return value

    @field_validator("function")
    @classmethod
    def _importable_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(FUNCTION_PATTERN, value):
            raise ValueError(f"{value!r} must name a function as 'package.module:function'")
        return value

    @field_validator("reward_model")
    @classmethod
    def _a_path(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be the path of a task: reward run's final/ folder")
        return value

    @property
    def kind(self) -> str:
        """Which of :data:`REWARD_KINDS` this item is."""
        return next(kind for kind in REWARD_KINDS if getattr(self, kind) is not None)

    @property
    def metric(self) -> str:
        """The name its scores are logged under: ``name``, else the function's name, else its kind."""
        if self.name is not None:
            return self.name
        if self.function is not None:
            return self.function.rsplit(":", 1)[1]
        return self.kind


class GRPOConfig(Section):
    """Group relative policy optimization (``task: grpo``): the policy generates ``group_size`` completions per
    prompt, the rewards score them, and each completion's advantage is its reward against its group's.
    train.global_batch_size and train.micro_batch_size count prompts."""

    group_size: int = Field(default=4, ge=2, description="completions generated per prompt (the group whose "
                                                         "rewards are normalised together)")
    max_new_tokens: int = Field(
        default=32, ge=1, description="tokens generated per completion at most; prompts are cut (their end kept) to "
                                      "data.max_seq_len - max_new_tokens",
    )
    temperature: float = Field(default=1.0, gt=0, description="sampling temperature of the generation")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens "
                                                             "holding this much probability (1: all)")
    beta: float = Field(default=0.0, ge=0, description="weight of the KL penalty to the reference (initial) "
                                                       "model; 0: no reference pass")
    epsilon: float = Field(default=0.2, gt=0, description="the policy ratio is clipped to [1 - epsilon, "
                                                          "1 + epsilon]")
    iterations: int = Field(default=1, ge=1, description="optimizer updates per batch of generated completions")
    loss: Literal["grpo", "token", "dr_grpo"] = Field(
        default="grpo",
        description="how token losses are averaged: grpo (each completion's mean, then the mean over completions), "
        "token (the sum over the batch's completion tokens / their count), dr_grpo (the sum / (completions x "
        "max_new_tokens))",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="the reward functions (task grpo needs at least one), each {exact_match: true} | {regex: "
        "pattern} | {function: 'pkg.module:function'} | {reward_model: path}, with weight: 1.0 and name",
    )

    @field_validator("rewards")
    @classmethod
    def _unique_names(cls, value: list[RewardSpec]) -> list[RewardSpec]:
        """Each reward's metric name is its own (two scores logged under one name would hide one)."""
        names = [spec.metric for spec in value]
        twice = sorted({name for i, name in enumerate(names) if name in names[:i]})
        if twice:
            raise ValueError(f"reward names must be unique, but {', '.join(map(repr, twice))} names more than one; "
                             "give the items distinct name: keys")
        return value


class DistillConfig(Section):
    """Distillation (``task: distill``): the student (the recipe's model) learns the next-token distributions of a
    frozen teacher of the same tokenizer, on the data's own answers (offline) or on its own samples (on_policy)."""

    teacher: str | None = Field(
        default=None, description="the teacher: a model folder (config.json + safetensors) or a finetune run (its "
        "final/) of the same vocabulary as the student; frozen, never saved (task distill needs one)")
    mode: Literal["offline", "on_policy"] = Field(
        default="offline", description="offline: the divergence on the data's answer tokens; on_policy: on "
        "completions the student samples from each row's prompt (a fraction lmbda of the steps), scored per token "
        "by the teacher")
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        default="forward_kl", description="the per-token divergence: forward_kl KL(teacher || student), reverse_kl "
        "KL(student || teacher), jsd the generalized Jensen-Shannon divergence with mixing coefficient beta")
    beta: float = Field(default=0.5, gt=0, lt=1, description="jsd's mixture beta * teacher + (1 - beta) * student")
    temperature: float = Field(
        default=1.0, gt=0, description="both distributions are softmax(logits / temperature) (not multiplied by "
        "temperature^2); on_policy samples at it too")
    alpha: float = Field(default=0.0, ge=0, le=1, description="offline: the loss is (1 - alpha) x divergence + "
                                                              "alpha x the data's cross-entropy")
    top_k: int | None = Field(
        default=None, ge=1, description="compare over the teacher's top_k tokens at each position, both "
        "distributions renormalized over them (null: the whole vocabulary)")
    lmbda: float = Field(
        default=1.0, ge=0, le=1, description="on_policy: the fraction of steps trained on the student's own "
        "completions (GKD's lambda; each step decided from train.seed), the others on the data's answers")
    max_new_tokens: int = Field(default=32, ge=1, description="on_policy: tokens sampled per completion at most")


class CheckpointConfig(Section):
    """Periodic checkpoints under <output_dir>/checkpoints/step-NNNNNN/."""

    every_steps: int | None = Field(default=None, ge=1, description="null: no periodic checkpoints")
    keep_last: int | None = Field(default=2, ge=1, description="null keeps all")
    save_final: bool = Field(default=True, description="export <output_dir>/final in Hugging Face format")


class PeftConfig(Section):
    """Parameter-efficient fine-tuning. Presets resolve to module names through the model's SupportedModel row."""

    method: Literal["none", "lora", "dora", "qlora"] = Field(
        default="none", description="none: full fine-tuning; lora; dora (weight-decomposed LoRA); qlora (LoRA over "
        "4-bit NF4 base weights, needs bitsandbytes)",
    )
    preset: Literal["attn", "attn_mlp", "all_linear"] = Field(
        default="attn_mlp", description="which modules get adapters, as the model's SupportedModel row names them: "
        "attention projections, attention and MLP, or every linear layer",
    )
    target_modules: list[str] | None = Field(default=None, description="explicit module names; overrides preset")
    r: int = Field(default=8, ge=1, description="the adapters' rank")
    alpha: float = Field(default=16, gt=0, description="the adapters' scale is alpha / r")
    dropout: float = Field(default=0.05, ge=0, lt=1, description="dropout on the adapters' input (train.dropout "
                           "false sets it to 0)")
    modules_to_save: list[str] | None = Field(
        default=None, description="trained in full and saved with the adapter; null: the classification head"
    )


class WandbConfig(Section):
    """Weights & Biases sink; offline unless mode says otherwise (an online run with no key would prompt)."""

    enabled: bool = Field(default=False, description="send the metrics to Weights & Biases (needs wandb installed)")
    project: str = Field(default="finetune", description="the W&B project")
    entity: str | None = Field(default=None, description="the W&B team or user; null: your default entity")
    mode: Literal["offline", "online"] = Field(
        default="offline", description="offline writes under the run directory for `wandb sync`; online uploads",
    )


class LoggingConfig(Section):
    """Where metrics go; metrics.jsonl and train.log are always written."""

    every_steps: int = Field(
        default=10, ge=1, description="the training metrics are logged every this many optimizer steps (and at the "
        "last step)",
    )
    progress: bool = Field(default=True, description="rich progress bar on rank 0 (only on a terminal)")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: bool = Field(
        default=False, description="also write TensorBoard scalars to <output_dir>/tensorboard (needs tensorboard)",
    )


class LaunchConfig(Section):
    """How many processes, which accelerate config (a name in accelerate_configs/ or a path), and how long a
    collective may wait for a rank."""

    accelerate_config: str = Field(
        default="cpu", description="a name in accelerate_configs/ or a path (the --accelerate-config flag sets it)",
    )
    num_processes: int = Field(
        default=1, ge=1, description="processes (data-parallel ranks; the --num-processes flag sets it)",
    )
    timeout_minutes: float = Field(
        default=30.0, gt=0,
        description="how long a collective (all-reduce, barrier, process-group setup) may wait for the slowest rank "
        "before the run fails; for every backend (NCCL's own default is 10). Tokenization and downloads happen "
        "before the process group exists and checkpoint hashing holds no rank, so this bounds real stalls only",
    )


class RecipeConfig(Section):
    """A whole recipe, as written to <output_dir>/recipe.resolved.yaml."""

    name: str = Field(description="one path component (runs/<name>): letters, digits, . _ + -")
    output_dir: str | None = Field(default=None, description="null: runs/<name>")
    task: Literal["sft", "dpo", "reward", "grpo", "distill"] | None = Field(
        default=None,
        description="the objective: null = the model row's own task; sft = causal LM; dpo = direct preference "
        "optimization and reward = a reward model (both need data.format: preference); grpo = online RL from "
        "rewards on the policy's own completions (needs data.format: prompt and grpo.rewards); distill = the "
        "student learns a teacher's token distributions (needs distill.teacher)",
    )
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    optim: OptimConfig = Field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    peft: PeftConfig = Field(default_factory=PeftConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not re.fullmatch(NAME_PATTERN, value):
            raise ValueError("must be one folder name (it becomes runs/<name>): up to 100 letters, digits, '.', '_', "
                             "'+' or '-', starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _batch_arithmetic(self) -> RecipeConfig:
        per_step = self.train.micro_batch_size * self.launch.num_processes
        if self.train.global_batch_size % per_step:
            raise ValueError(batch_hint(self.train.global_batch_size, self.train.micro_batch_size,
                                        self.launch.num_processes))
        return self

    @model_validator(mode="after")
    def _dropout_by_task(self) -> RecipeConfig:
        """train.dropout null is the task's: off where a loss compares scores made without dropout."""
        if self.train.dropout is None:
            self.train.dropout = objectives.dropout_default(self.task)
        return self

    @model_validator(mode="after")
    def _stream_length(self) -> RecipeConfig:
        """A stream has no epoch length, so only train.max_steps can say how long to train; dpo scores its
        reference log-probs over the whole train split before training."""
        if self.data.streaming and self.train.max_steps is None:
            raise ValueError("data.streaming: true needs train.max_steps (a stream has no epoch length for "
                             f"train.epochs={self.train.epochs:g} to count); set train.max_steps and train.epochs: "
                             "null")
        record = objectives.objective(self.task)
        if self.data.streaming and record is not None and record.no_streaming:
            raise ValueError(f"data.streaming: true cannot run task {self.task} ({record.no_streaming}); set "
                             "data.streaming: false")
        return self

    @model_validator(mode="after")
    def _grpo_prompts(self) -> RecipeConfig:
        """task grpo learns from prompts and rewards; prompt rows are only for task grpo; the prompt leaves room for
        the completion."""
        record = objectives.objective(self.task)
        if record is not None and record.rewards and not self.grpo.rewards:
            raise ValueError("grpo.rewards: task grpo needs at least one reward, e.g. [{exact_match: true}]")
        if record is not None and record.generates and self.grpo.max_new_tokens >= self.data.max_seq_len:
            raise ValueError(f"grpo.max_new_tokens={self.grpo.max_new_tokens} leaves no room for the prompt in "
                             f"data.max_seq_len={self.data.max_seq_len}; raise data.max_seq_len or lower "
                             "grpo.max_new_tokens")
        return self

    @model_validator(mode="after")
    def _distill_settings(self) -> RecipeConfig:
        """task distill needs a teacher; on_policy samples leave room for the prompt and train no cross-entropy on
        the student's own samples."""
        record = objectives.objective(self.task)
        if record is None or not record.teacher:
            return self
        distill = self.distill
        if not distill.teacher:
            raise ValueError("distill.teacher: task distill needs a teacher (a model folder or a finetune run of the "
                             "student's tokenizer)")
        if distill.mode == "on_policy":
            if distill.alpha:
                raise ValueError(f"distill.alpha={distill.alpha:g} mixes in the data's cross-entropy, which "
                                 "distill.mode=on_policy does not train (its targets are the student's own samples); "
                                 "set distill.alpha=0 or distill.mode=offline")
            if distill.max_new_tokens >= self.data.max_seq_len:
                raise ValueError(f"distill.max_new_tokens={distill.max_new_tokens} leaves no room for the prompt in "
                                 f"data.max_seq_len={self.data.max_seq_len}; raise data.max_seq_len or lower "
                                 "distill.max_new_tokens")
            if self.data.packing:
                raise ValueError("data.packing: distill.mode=on_policy trains on completions it samples, one per "
                                 "row; set data.packing=false")
        return self

    @property
    def grad_accum(self) -> int:
        """Micro-steps per optimizer step on each rank (derived, never configured)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.launch.num_processes)


def batch_hint(global_bs: int, micro_bs: int, procs: int) -> str:
    """Explain why a global batch does not divide, and which nearby numbers would."""
    per_step = micro_bs * procs
    lower = max(per_step, global_bs // per_step * per_step)
    upper = (global_bs // per_step + 1) * per_step
    micro_ok = [m for m in range(1, global_bs + 1) if global_bs % (m * procs) == 0][:8]
    micro_txt = ", ".join(map(str, micro_ok)) if micro_ok else "none (global batch < processes)"
    return (
        f"train.global_batch_size={global_bs} is not a multiple of train.micro_batch_size={micro_bs} x "
        f"{procs} process(es) = {per_step}; use global_batch_size {' or '.join(map(str, sorted({lower, upper})))}, "
        f"or micro_batch_size one of {micro_txt}"
    )


def recipe_file_schema() -> dict[str, Any]:
    """The JSON Schema of a recipe *file*, for editors (``finetune schema``; yaml-language-server, VS Code, PyCharm).

    It is :class:`RecipeConfig`'s own schema (every key, type, range, enum, default and description; unknown keys
    are errors), with two differences that make it right for a file rather than for a composed recipe:
    ``extends:`` is allowed at the top, and nothing is required, because a file may be a preset or a fragment that
    its bases, the shipped defaults or dotted overrides complete. ``finetune config FILE`` checks the whole.
    The batch arithmetic and the checks against the model table and the file system stay in finetune."""
    schema = RecipeConfig.model_json_schema()

    def optional(node: Any) -> None:
        if isinstance(node, dict):
            node.pop("required", None)
            for child in node.values():
                optional(child)
        elif isinstance(node, list):
            for child in node:
                optional(child)

    optional(schema)
    schema["properties"]["extends"] = {
        "description": "recipe files this one builds on, applied in order before this file's keys (paths relative "
                       "to this file, or shipped names such as presets/lora.yaml)",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    }
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "finetune recipe file"}
