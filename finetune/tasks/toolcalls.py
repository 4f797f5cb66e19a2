"""The ``tool_calls`` eval metric: a generated answer's tool calls, parsed, against the reference turn's calls.

A call is compared as data, never as text: its function name, and its arguments as the JSON object they are (key
order, spacing and quoting do not matter). An answer is correct when it makes exactly the reference's calls, in
order. The reference is the eval row's last assistant turn's ``tool_calls`` (stored with the tokenized row as JSON,
``calls``: :func:`reference_calls`); a row whose last turn calls no tool is not counted.

Where the generated calls are found, in this order:

- the tokenizer's own response parser, where the model's tokenizer has a response schema
  (``tokenizer.parse_response``, transformers' reading of what its chat template writes);
- else every JSON object in the text that is a call: ``{"name", "arguments"}`` (Hermes and Qwen's
  ``<tool_call>`` blocks, Mistral's list), ``{"name", "parameters"}`` (Llama 3.1), or the OpenAI
  ``{"type": "function", "function": {...}}`` form. Templates that write calls in another notation (GPT-OSS's
  ``to=functions.NAME`` channel, GLM's ``<arg_key>`` pairs) need a tokenizer with a response schema to be scored.
"""

from __future__ import annotations

import json
from typing import Any

from finetune.data.rows import Call, normal_call


def json_calls(text: str) -> list[Call]:
    """Every JSON object (or list of objects) in ``text`` that is a call, in order (see the module docstring)."""
    decoder = json.JSONDecoder()
    found: list[Call] = []
    at = 0
    while True:
        starts = [i for i in (text.find("{", at), text.find("[", at)) if i >= 0]
        if not starts:
            return found
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            at = start + 1
            continue
        items = value if isinstance(value, list) else [value]
        calls = [normal_call(item) for item in items]
        if calls and all(call is not None for call in calls):
            found += [call for call in calls if call is not None]
            at = end
        else:
            at = start + 1


def parsed_calls(text: str, tokenizer: Any) -> list[Call]:
    """The calls of a generated answer: by the tokenizer's response parser where it has a schema, else
    :func:`json_calls`."""
    if getattr(tokenizer, "response_schema", None) or getattr(tokenizer, "response_template", None):
        try:
            message = tokenizer.parse_response(text)
            calls = [normal_call(call) for call in (message or {}).get("tool_calls") or []]
            return [call for call in calls if call is not None]
        except Exception:  # a response the schema cannot read makes no call
            return []
    return json_calls(text)


def correct(text: str, reference: str, tokenizer: Any) -> bool:
    """Whether a generated answer makes exactly the ``reference`` calls (stored by
    :func:`finetune.data.rows.reference_calls`), in order, each name and arguments equal as data."""
    want = [(name, arguments) for name, arguments in json.loads(reference)]
    return parsed_calls(text, tokenizer) == want
