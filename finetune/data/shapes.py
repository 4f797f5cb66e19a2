"""Rows written in another common shape, read as their format's own fields at the edge.

A format names the fields its rows hold (``chat``: ``messages``, a list of ``{role, content}``). Data sets are often
written in another shape that says the same; a :class:`Shape` turns such a row into the format's own fields before
anything else sees it, so the row checks, rendering, label masking, the tokenized columns and everything after them
are the same as for the row written in the format's own fields.

A shape is selected row by row, by a **marker** field: a row whose marker is set and whose format field is not is
read through the shape; a row with both is refused (one line naming the file and row); a row with neither is left
to the format's own check (which names the missing field). A source's batch function is handed the shapes of its
format (:func:`reading`: each shape's name and its rule as text), so the tokenized cache key holds the rule: a
cached tokenization is never reused under another rule (and this module's source is part of
:data:`finetune.data.tokenize.CODE_VERSION`). A new shape (a recipe's column mapping) is one more entry of
:data:`SHAPES`, with its rule text.

The shapes:

- **ShareGPT** (``chat``): ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}``,
  with an optional row-level ``system`` string (as some exports have). Each turn becomes ``{role, content}`` by
  :data:`SHAREGPT_ROLES`, the speaker names of the ShareGPT dumps and of the converters of LLaMA-Factory (its
  ``sharegpt`` tags), axolotl (its default role map) and FastChat:

  ======================================  ==========  =================================================
  ``from``                                ``role``    where the name comes from
  ======================================  ==========  =================================================
  ``system``                              system      LLaMA-Factory, axolotl
  ``human``, ``user``                     user        the dumps, LLaMA-Factory, axolotl
  ``gpt``, ``assistant``                  assistant   the dumps, LLaMA-Factory, axolotl
  ``chatgpt``, ``bing``, ``bard``         assistant   the dumps (the model that answered), FastChat
  ``function_call``                       assistant   LLaMA-Factory (the assistant's tool call, as JSON)
  ``observation``, ``tool``               tool        LLaMA-Factory (a tool's result), axolotl
  ======================================  ==========  =================================================

  A non-empty ``system`` field becomes a first ``{role: system}`` message; a row with both that field and a
  ``system`` turn is refused (which one is meant is not known). A ``function_call`` turn's value is the call as
  JSON (``{name, arguments}`` or a list of them) and becomes an assistant message with ``tool_calls``; an answer
  holding Hermes' ``<tool_call>{...}</tool_call>`` blocks becomes one with those calls (and the rest as content). A
  call that is not such JSON is one line saying how to write it. A turn's other keys are not read. An unknown
  ``from``, a turn without ``from`` or ``value``, or a ``value`` that is not a string: one line naming the file,
  the row and the turn.
- **Conversational prompt-completion** (``chat``, TRL's shape): ``{"prompt": [messages], "completion": [assistant
  messages]}`` is the messages of both, the prompt's own assistant turns marked ``train: false``: the completion is
  what is learned (:func:`prompt_completion_messages`).

Two more shapes of TRL's are read where their format reads rows, since they are not a field mapping: string
prompt-completion rows of ``completion`` (:func:`finetune.data.formats.render_completion`) and preference pairs
with an explicit conversational prompt (:func:`explicit_pair`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.data.rows import line_of, short_repr
from finetune.errors import DataError

# ShareGPT speaker names -> chat roles (see the module docstring for where each comes from)
SHAREGPT_ROLES: dict[str, str] = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "function_call": "assistant",
    "observation": "tool", "tool": "tool",
}


def sharegpt_messages(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The ``messages`` of a ShareGPT row (``conversations`` and its optional ``system`` field), or one DataError
    line naming ``where`` (the row's file and line) and what to fix."""
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list of {{from, value}} turns, got "
                        f"{short_repr(turns)}")
    messages = []
    for i, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if speaker is None or value is None:
            missing = " and ".join(k for k, v in (("from", speaker), ("value", value)) if v is None)
            raise DataError(f"{where}: conversations[{i}] has no {missing!s}; a ShareGPT turn is {{from, value}}, "
                            f"got {short_repr(turn)}")
        if speaker not in SHAREGPT_ROLES:
            raise DataError(f"{where}: conversations[{i}].from {short_repr(speaker)} is not a known ShareGPT speaker; "
                            f"use one of {', '.join(SHAREGPT_ROLES)}")
        if not isinstance(value, str):
            raise DataError(f"{where}: conversations[{i}].value must be a string, got {short_repr(value)}")
        if speaker == "function_call":  # LLaMA-Factory / Hermes: the call, as JSON
            messages.append({"role": "assistant", "content": None,
                             "tool_calls": _calls_of(value, f"{where}: conversations[{i}]")})
            continue
        role = SHAREGPT_ROLES[speaker]
        if role == "assistant" and TOOL_CALL.search(value):  # Hermes: <tool_call>{json}</tool_call> in the answer
            text = TOOL_CALL.sub("", value).strip()
            calls = [call for found in TOOL_CALL.findall(value)
                     for call in _calls_of(found, f"{where}: conversations[{i}]")]
            messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
            continue
        messages.append({"role": role, "content": value})
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: field 'system' must be a string (the conversation's system prompt), got "
                        f"{short_repr(system)}")
    if system:
        if messages[0]["role"] == "system":
            raise DataError(f"{where}: both a 'system' field and a system turn (conversations[0]); keep one of them")
        messages.insert(0, {"role": "system", "content": system})
    return messages


def prompt_completion_messages(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The ``messages`` of a conversational prompt-completion row (TRL's shape: ``{"prompt": [messages],
    "completion": [assistant messages]}``): the prompt's messages then the completion's, every assistant turn of
    the prompt marked ``train: false`` (the completion is what is learned, as TRL trains it)."""
    prompt, completion = row.get("prompt"), row["completion"]
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, list) or not value:
            raise DataError(f"{where}: field {name!r} of a conversational prompt-completion row must be a non-empty "
                            f"list of {{role, content}} messages, got {short_repr(value)}")
    kept = [{**message, "train": False} if isinstance(message, dict) and message.get("role") == "assistant"
            else message for message in prompt]
    return [*kept, *completion]


def explicit_pair(row: dict[str, Any]) -> dict[str, Any]:
    """A preference row with an explicit conversational prompt (``{"prompt": [messages], "chosen": [messages],
    "rejected": [messages]}``, TRL's shape) as the implicit form every check and render reads: each answer's
    messages after the shared prompt's, ``prompt`` dropped. Any other row as it is."""
    prompt, chosen, rejected = row.get("prompt"), row.get("chosen"), row.get("rejected")
    if not (isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list)):
        return row
    return {**{k: v for k, v in row.items() if k != "prompt"}, "chosen": [*prompt, *chosen],
            "rejected": [*prompt, *rejected]}


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)  # Hermes' call inside an answer


def _calls_of(text: str, where: str) -> list[dict[str, Any]]:
    """The tool calls a ShareGPT ``function_call`` value (or a Hermes ``<tool_call>`` block) holds: JSON
    ``{name, arguments}`` or a list of them, as OpenAI ``tool_calls``; else one DataError line saying how to write
    the turn."""
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    calls = found if isinstance(found, list) else [found]
    if not calls or not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in calls):
        raise DataError(f"{where}: a tool call must be JSON {{\"name\": ..., \"arguments\": {{...}}}} (or a list of "
                        f"them), got {short_repr(text)}; or write the turn as an assistant message with tool_calls")
    return [{"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
            for call in calls]


@dataclass(frozen=True)
class Shape:
    """One other way of writing a format's rows: its ``name``; the ``formats`` it applies to; the ``marker`` field
    that says a row is written this way; the format's own ``field`` it stands for; ``convert(row, where)``, that
    field's value; ``rule``, the text of everything that decides the conversion (part of the cache key); and
    ``consumes``, the row's other fields the conversion reads and replaces (dropped with the marker)."""

    name: str
    formats: tuple[str, ...]
    marker: str
    field: str
    convert: Callable[[dict[str, Any], str], Any]
    rule: Callable[[], str]
    consumes: tuple[str, ...] = ()


SHAPES: tuple[Shape, ...] = (
    Shape("sharegpt", ("chat",), "conversations", "messages", sharegpt_messages,
          lambda: "sharegpt:" + json.dumps(SHAREGPT_ROLES, sort_keys=True) + ":system-field-first"
          + ":function_call-as-tool_calls:" + TOOL_CALL.pattern),
    Shape("conversational prompt-completion", ("chat",), "completion", "messages", prompt_completion_messages,
          lambda: "prompt-completion:prompt+completion:prompt-assistant-untrained", consumes=("prompt",)),
)
Reading = tuple[tuple[str, str], ...]  # (shape name, its rule) of each shape a source is read through


def shapes_of(fmt: str) -> tuple[Shape, ...]:
    """The shapes rows of ``fmt`` may be written in."""
    return tuple(shape for shape in SHAPES if fmt in shape.formats)


def reading(fmt: str) -> Reading:
    """What a batch function of ``fmt`` is handed: each shape's name and rule (so the cache key holds them)."""
    return tuple((shape.name, shape.rule()) for shape in shapes_of(fmt))


def columns(fmt: str, names: list[str]) -> list[str]:
    """The fields a table of columns ``names`` gives rows of ``fmt``: its own, plus the field each shape whose
    marker is a column stands for (what the format's column check looks for)."""
    given = [shape.field for shape in shapes_of(fmt) if shape.marker in names and shape.field not in names]
    return [*names, *given]


def alternatives(fmt: str, field: str) -> str:
    """How an error about a missing ``field`` of ``fmt`` names the shapes that also give it (empty: none)."""
    others = [f"or {shape.name} {shape.marker!r}" for shape in shapes_of(fmt) if shape.field == field]
    return f" ({', '.join(others)})" if others else ""


def _active(read: Reading) -> list[Shape]:
    names = {name for name, _ in read}
    return [shape for shape in SHAPES if shape.name in names]


def normalize_row(row: dict[str, Any], read: Reading, where: str) -> dict[str, Any]:
    """``row`` with each shape of ``read`` applied where its marker is set (see the module docstring); the row
    itself when none applies."""
    for shape in _active(read):
        marked = row.get(shape.marker)
        if marked is None:
            continue
        if row.get(shape.field) is not None:
            raise DataError(f"{where}: both {shape.field!r} and {shape.marker!r} are set; a row has one of them "
                            f"({shape.field}, or {shape.name} {shape.marker})")
        gone = {shape.marker, *shape.consumes}
        converted = shape.convert(row, where)
        row = {key: value for key, value in row.items() if key not in gone}
        row[shape.field] = converted
    return row


def normalize_batch(batch: Any, indices: list[int], read: Reading, source: str) -> Any:
    """A batch of columns (``datasets``' batch, or a dict of lists) with each row of ``read``'s shapes read as the
    format's own fields (:func:`normalize_row`; ``indices``: the rows' numbers in ``source``, for the errors). The
    batch itself when no shape's marker is a column (no row to convert: nothing is copied)."""
    active = [shape for shape in _active(read) if shape.marker in batch]
    if not active:
        return batch
    names = list(batch)
    rows = [dict(zip(names, values, strict=True)) for values in zip(*(batch[name] for name in names), strict=True)]
    rows = [normalize_row(row, read, line_of(source, index)) for row, index in zip(rows, indices, strict=True)]
    gone = {name for s in active for name in (s.marker, *s.consumes)}
    out_names = list(dict.fromkeys([*(n for n in names if n not in gone), *(s.field for s in active)]))
    return {name: [row.get(name) for row in rows] for name in out_names}


__all__ = ["SHAPES", "SHAREGPT_ROLES", "Reading", "Shape", "alternatives", "columns", "explicit_pair",
           "normalize_batch", "normalize_row", "prompt_completion_messages", "reading", "shapes_of",
           "sharegpt_messages"]
