"""``model.chat_template``: the chat template a recipe gives its model's tokenizer, by name or as a file.

A value is either a **name** from :data:`NAMED` (a bare word: letters, digits, ``_`` and ``-``) or the **path** of a
Jinja file (anything else: it has a ``/`` or a suffix such as ``.jinja``), relative to the recipe file that sets it
(a dotted override: to the working directory), like a data path. Null keeps the tokenizer's own template.

The template's text replaces the tokenizer's ``chat_template`` where the tokenizer is loaded
(:func:`finetune.runtime.modeling.build_tokenizer`), so every render (training, eval, ``finetune generate``, GRPO
prompts) goes through it, the tokenized-data cache key and the run's tokenizer fingerprint hold it, and the export
saves it with the tokenizer. No torch, no transformers: the CLI validates recipes with these functions.

The named templates are data, written by hand from each format's definition.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetune.errors import ConfigError

# ChatML: every message is "<|im_start|>" + role + "\n" + content + "<|im_end|>" + "\n"; the generation prompt is
# "<|im_start|>assistant\n". An assistant turn ends at its "<|im_end|>" (what training learns as the turn's end).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Hermes function calling (as NousResearch's Hermes and Qwen2.5 write it) on ChatML: the tools' JSON schemas in the
# system turn between <tools></tools>, one per line; a call as <tool_call>\n{"name": ..., "arguments": {...}}\n
# </tool_call> in the assistant's turn (after its text, if any); a tool's result as a "tool" turn holding
# <tool_response>\n...\n</tool_response>; an assistant's reasoning_content as <think>\n...\n</think>\n\n before
# the rest of its turn, in every turn (so a conversation renders prefix-wise).
HERMES = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set function = call.function if call.function is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + function.name + '\", \"arguments\": ' + (function.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

NAMED: dict[str, str] = {"chatml": CHATML, "hermes": HERMES}  # name -> the template's Jinja text
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]+")
MAX_BYTES = 1 << 20  # a chat template file larger than 1 MiB is refused before it is read (real ones are a few KiB)
KEY = "model.chat_template"


def is_name(value: str) -> bool:
    """Whether ``value`` names a template (a bare word) rather than a file (see the module docstring)."""
    return NAME_PATTERN.fullmatch(value) is not None


def name_problem(value: str) -> str | None:
    """Why ``value`` cannot be a chat template value as written, without looking at files: blank, or a name that is
    not in :data:`NAMED` (one line listing the names); None when it may be."""
    if not value.strip():
        return f"empty; give a template name ({', '.join(NAMED)}) or the path of a .jinja file"
    if is_name(value) and value not in NAMED:
        return f"{value!r} is not a named chat template; use one of {', '.join(NAMED)}, or the path of a .jinja file"
    return None


def file_problem(value: str) -> str | None:
    """Why the file ``value`` names cannot be read as a template (missing, a folder, too large), in one line that
    starts with the key; None for a name or a readable file."""
    if is_name(value):
        return None
    path = Path(value)
    if not path.exists():
        return f"{KEY}: file not found: {value}"
    if not path.is_file():
        return f"{KEY}: {value} is not a file; give the path of a .jinja file"
    if path.stat().st_size > MAX_BYTES:
        return f"{KEY}: {value} is larger than {MAX_BYTES} bytes; a chat template is a few KiB of Jinja"
    return None


def text_of(value: str) -> str:
    """The Jinja text ``value`` gives: a named template's, or the file's (UTF-8). One ConfigError line when a name
    is unknown or the file cannot be read."""
    problem = name_problem(value)
    if problem:
        raise ConfigError(f"{KEY}: {problem}")
    if is_name(value):
        return NAMED[value]
    problem = file_problem(value)
    if problem:
        raise ConfigError(problem)
    try:
        return Path(value).read_bytes().decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise ConfigError(f"{KEY}: {value} is not UTF-8 text; save the template as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{KEY}: {value} cannot be read ({exc.strerror or exc})") from None


__all__ = ["CHATML", "KEY", "NAMED", "file_problem", "is_name", "name_problem", "text_of"]


# ``model.chat_template_kwargs``: values a template reads (``enable_thinking: false``), fixed for the model
ARGUMENTS_KEY = "model.chat_template_kwargs"
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what the renderer gives every template itself: a recipe cannot set these
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "raise_exception", "strftime_now"})


def arguments_problem(arguments: dict[str, object]) -> str | None:
    """Why ``arguments`` cannot be template arguments (a name that is no Jinja name, or one the renderer sets
    itself), in one line; None when they can."""
    for name in arguments:
        if not IDENTIFIER.fullmatch(name):
            return f"{name!r} is not a name a template can read (letters, digits and _, not first a digit)"
        if name in RESERVED:
            return f"{name!r} is given to every template by the renderer itself; a recipe cannot set it"
    return None


def with_arguments(template: str, arguments: dict[str, object]) -> str:
    """``template`` with ``arguments`` set first (``{%- set enable_thinking = false %}``): a value set in the
    template wins over one passed to the render, so every render reads it (training, eval, generate, GRPO) and so
    does any server given the exported tokenizer. Values are JSON scalars: written as Jinja literals."""
    lines = "".join(f"{{%- set {name} = {_literal(value)} %}}\n" for name, value in arguments.items())
    return lines + template


def _literal(value: object) -> str:
    """A JSON scalar as a Jinja literal: true/false, a number, a double-quoted string with JSON's escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)
