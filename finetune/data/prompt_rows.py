"""Prompt rows (``data.format: prompt``, task grpo): what the policy generates from, and what its rewards read.

A row is ``{"prompt": text, ...}`` or ``{"messages": [...], ...}`` (or ``{"prompt": [...]}``, TRL's conversational
prompt, read as ``messages``), a chat without its final assistant turn (its last message is the user's, or a system
message), which the policy writes. Its prompt goes through the one
rendering path of generation prompts (:mod:`finetune.data.prompts`): a text as it is, a chat through the tokenizer's
template with the generation prompt; the special tokens of every prompt (``data.add_bos``);
and, over ``data.max_seq_len -
grpo.max_new_tokens`` tokens, the end kept (the cue to answer is at the end), counted as truncated like other
formats' samples (``data.overlong: drop`` drops such a row instead). Every other field of the row (``answer``,
test cases, ...) is kept, as JSON, for the reward functions.

The tokenized split has the columns ``input_ids`` (the prompt's ids), ``prompt`` (its rendered text, whole),
``fields`` (a JSON object of the row's other fields), ``index`` (the row's position in its split as read:
its source's row number, the rows of a split's earlier sources counted first) and ``templated`` (a ``messages``
row: its prompt is the chat template's render). :class:`PromptCollator` makes a
batch of them, left-padded so generation starts at one column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.data import prompts
from finetune.data.batched import rendered
from finetune.data.bos import Lead
from finetune.data.rows import check_turns, line_of, short_repr, tools_of
from finetune.errors import DataError
from finetune.objectives import objective

if TYPE_CHECKING:
    from datasets import Dataset, Features

    from finetune.config.schema import RecipeConfig

FORMAT = "prompt"
PROMPT_KEYS = ("prompt", "messages")  # what a row's prompt is written as (exactly one of them)
COLUMNS = ("input_ids", "prompt", "fields", "index", "templated")
FORMS = "prompt (text, or a message list) or messages (a chat without its final assistant turn)"
WHY = {"answer": "the exact_match reward and metric compare each completion with the row's answer"}


@dataclass(frozen=True)
class PromptOptions:
    """What tokenizing prompt rows needs from outside ``data:``: ``new_tokens`` (``grpo.max_new_tokens`` or
    ``distill.max_new_tokens``: the room a prompt leaves in ``data.max_seq_len`` for its completion, named by
    ``room_key``) and the fields every train row (``require``) and eval row (``eval_require``) must have."""

    new_tokens: int = 0
    require: tuple[str, ...] = ()
    eval_require: tuple[str, ...] = ()
    room_key: str = "grpo.max_new_tokens"  # the recipe key of new_tokens, as the data's lines name it

    @classmethod
    def of(cls, cfg: RecipeConfig) -> PromptOptions | None:
        """The options of a recipe (None unless its task reads prompt rows: its record's ``prompt_section``, whose
        ``max_new_tokens`` is the completion's room): rows need ``answer`` where an exact_match reward (train and
        eval) or the exact_match eval metric (eval) compares completions with it."""
        record = objective(cfg.task)
        if record is None or record.prompt_section is None:
            return None
        exact = record.rewards and any(spec.exact_match for spec in cfg.grpo.rewards)
        return cls(getattr(cfg, record.prompt_section).max_new_tokens, ("answer",) if exact else (),
                   ("answer",) if exact or "exact_match" in cfg.eval.metrics else (),
                   f"{record.prompt_section}.max_new_tokens")


def check_columns(dataset: Any, source: str, require: tuple[str, ...] = ()) -> None:
    """Cheap checks of the whole table: rows exist, their prompt is written as one of :data:`PROMPT_KEYS`, and
    the fields in ``require`` are columns."""
    if not len(dataset):
        raise DataError(f"{source}: no rows")
    names = dataset.column_names
    found = ", ".join(names) or "none"
    header = Path(source).suffix == ".csv"
    if not any(key in names for key in PROMPT_KEYS):
        where = f"{source}:1: the header has no column 'prompt'" if header else \
            f"{line_of(source, 0)}: missing field 'prompt'"
        raise DataError(f"{where} (prompt rows need {FORMS}; the rows have {found})")
    for name in require:
        if name not in names:
            where = f"{source}:1: the header has no column {name!r}" if header else \
                f"{line_of(source, 0)}: missing field {name!r}"
            raise DataError(f"{where} ({WHY.get(name, 'the recipe needs it')}; the rows have {found})")


def read_row(row: dict[str, Any]) -> dict[str, Any]:
    """A prompt row as the rest of this module reads it: a ``prompt`` written as a message list (TRL's
    conversational prompt) is its ``messages``."""
    if isinstance(row.get("prompt"), list) and row.get("messages") is None:
        return {**{key: value for key, value in row.items() if key != "prompt"}, "messages": row["prompt"]}
    return row


def check_row(row: dict[str, Any], index: int, source: str, require: tuple[str, ...] = ()) -> None:
    """Raise one DataError naming file, line and field when row ``index`` of ``source`` is not a prompt row."""
    row = read_row(row)
    where = line_of(source, index)
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is not None and messages is not None:
        raise DataError(f"{where}: both 'prompt' and 'messages' are set; a prompt row has one of them ({FORMS})")
    if prompt is None and messages is None:
        raise DataError(f"{where}: missing field 'prompt' (prompt rows need {FORMS})")
    tools_of(row, where)  # a list of tool schemas (the template renders them), or none
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise DataError(f"{where}: field 'prompt' must be a non-empty string, got {short_repr(prompt)}")
    if messages is not None:
        check_turns(messages, where)
        if messages[-1]["role"] == "assistant":
            raise DataError(f"{where}: the last message is the assistant's, but a prompt row is a chat without its "
                            "final assistant turn (the policy writes it); end with a user (or system) message")
    for name in require:
        if row.get(name) is None:
            raise DataError(f"{where}: missing field {name!r} ({WHY.get(name, 'the recipe needs it')})")


def fields_of(row: dict[str, Any]) -> dict[str, Any]:
    """The row's fields for the reward functions: all but its prompt, and none that is null (a file's rows are
    read as one table, so a field some rows lack is null in them)."""
    return {key: value for key, value in row.items() if key not in PROMPT_KEYS and value is not None}


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as written: the null keys that reading rows as one table added are left out."""
    return [{key: value for key, value in msg.items() if value is not None} for msg in messages]


def templated(row: dict[str, Any]) -> bool:
    """Whether a prompt row's text is a chat template's render (a ``messages`` row) rather than its own text."""
    return row.get("prompt") is None


def prompt_text(row: dict[str, Any], tokenizer: Any) -> str:
    """The text the policy continues: a text prompt as it is, a chat through the template with its generation
    prompt (:func:`finetune.data.prompts.chat_text`)."""
    if row.get("prompt") is not None:
        return row["prompt"]
    return prompts.chat_text(_messages(row["messages"]), tokenizer, tools_of(row, "the row"))


def prompt_batch(batch: Any, indices: list[int], *, tokenizer: Any, max_len: int, add_bos: str, source: str,
                 require: tuple[str, ...] = (), code_version: str = "") -> dict[str, list]:
    """Prompt rows as the tokenized columns (plus ``overlong`` and ``n_labels``, which ``tokenize_rows`` reads and
    drops): each row checked, rendered, tokenized by the prompts' rules (one tokenizer call per batch, then the
    special tokens of ``data.add_bos`` (:class:`finetune.data.bos.Lead`; a chat is a template's render) and the end
    kept, as :func:`finetune.data.prompts.text_prompt` does row by row). ``code_version`` is part of the map's cache
    key only."""
    names = list(batch)
    rows = [dict(zip(names, values, strict=True)) for values in zip(*(batch[n] for n in names), strict=True)]
    texts = []
    rows = [read_row(row) for row in rows]
    for index, row in zip(indices, rows, strict=True):
        check_row(row, index, source, require)
        texts.append(rendered(lambda row=row: prompt_text(row, tokenizer), line_of(source, index),
                              "the tokenizer's chat template rejects this conversation"))
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    lead = Lead.of(tokenizer, add_bos)
    columns: dict[str, list] = {name: [] for name in (*COLUMNS, "overlong", "n_labels")}
    for index, row, text, ids in zip(indices, rows, texts, encoded, strict=True):
        kept = prompts.keep_end(lead.encode(text, ids, templated(row)), max_len)  # a chat: the template's render
        columns["input_ids"].append(kept.ids)
        columns["prompt"].append(text)
        columns["fields"].append(json.dumps(fields_of(row), ensure_ascii=False, default=str))
        columns["index"].append(index)
        columns["templated"].append(templated(row))
        columns["overlong"].append(kept.truncated)
        columns["n_labels"].append(1)  # a prompt is always usable: its completion is what is learned
    return columns


def output_features() -> Features:
    """The column types of a tokenized prompt split (with the two ``tokenize_rows`` reads and drops)."""
    from datasets import Features, Sequence, Value  # lazy: heavy

    return Features({"input_ids": Sequence(Value("int32")), "prompt": Value("string"), "fields": Value("string"),
                     "index": Value("int64"), "templated": Value("bool"), "overlong": Value("bool"),
                     "n_labels": Value("int64")})


def shift_index(dataset: Dataset, offset: int) -> Dataset:
    """``dataset`` with ``offset`` added to its ``index`` column: a later source's rows of one split are numbered
    after the rows of the sources before it."""
    if not offset:
        return dataset
    return dataset.map(lambda batch: {"index": [i + offset for i in batch["index"]]}, batched=True)


class PromptCollator:
    """A batch of tokenized prompt rows: ``prompt_ids`` and ``prompt_mask`` (LongTensor ``[B, L]``, LEFT-padded
    with ``pad_id`` so every prompt ends at the last column, where generation starts), ``prompts`` (the rendered
    texts), ``rows`` (each row's other fields, parsed), ``index`` (LongTensor ``[B]``, each row's position in
    its split) and ``templated`` (whether each prompt is a chat template's render, for a reward model's tokens)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch  # imports torch: the collator runs in the training process only

        from finetune.data.batching import left_pad  # imports torch

        ids, mask = left_pad([r["input_ids"] for r in rows], self.pad_id)
        return {"prompt_ids": ids, "prompt_mask": mask, "prompts": [r["prompt"] for r in rows],
                "rows": [json.loads(r["fields"]) for r in rows],
                "index": torch.tensor([r["index"] for r in rows], dtype=torch.long),
                "templated": [bool(r["templated"]) for r in rows]}


__all__ = ["COLUMNS", "FORMAT", "PromptCollator", "PromptOptions", "check_columns", "check_row", "output_features",
           "prompt_batch", "prompt_text", "shift_index"]
