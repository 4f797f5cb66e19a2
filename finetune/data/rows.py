"""What every data module shares about a row: the chat roles, the label that is never trained on, and how a row's
place and values are named in a one-line error.

The bottom of finetune/data: it imports none of the others, so loading, vision, batching, tokenize and prompts
can all import it without a circle. """

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.config.compose import COMPRESSIONS
from finetune.errors import DataError

ROLES = ("system", "user", "assistant", "tool")  # a tool turn (a tool's result) is prompt, as a user turn is
IGNORE = -100  # the label of a token that is not trained on (prompt, padding, image tokens)


# How row indices of a source that is not one whole file (a folder, a glob, a slice) are placed: its name (as
# messages show it) -> a function of the row index that says where the row is (finetune.data.loading.load_raw sets
# them when it reads the source; tokenizing workers are forked from that process and see them too; a worker started
# another way has none and names a row `source (row N)`).
_PLACES: dict[str, Callable[[int], str]] = {}


def data_suffix(path: str) -> str:
    """The suffix that says a data file's type, before a compression suffix: ``.jsonl`` for ``a.jsonl`` and
    ``a.jsonl.gz`` alike."""
    name = Path(path)
    suffix = name.suffix
    if suffix in COMPRESSIONS:
        return Path(name.stem).suffix
    return suffix


@functools.lru_cache(maxsize=64)
def _suffix(path: str) -> str:
    """:func:`data_suffix`, remembered: :func:`line_of` runs for every row tokenized (twice), and parsing the
    path each time cost as much as checking the row."""
    return data_suffix(path)


def place(name: str, where: Callable[[int], str] | None) -> None:
    """Say where the rows of the source called ``name`` are (``where(index)``), or, with None, that they are
    where :func:`line_of`'s own rule puts them (one whole file)."""
    if where is None:
        _PLACES.pop(name, None)
    else:
        _PLACES[name] = where


def line_of(path: str, index: int) -> str:
    """Where row ``index`` lives in its file, as ``file:line`` (csv counts its header line); for a source that is
    not one whole file, where :func:`place` said."""
    where = _PLACES.get(path)
    if where is not None:
        return where(index)
    return file_line(path, index)


def file_line(path: str, index: int) -> str:
    """Where row ``index`` of the whole file ``path`` is: ``file:line`` for JSON lines (compressed too) and csv
    (whose header is line 1), else ``file (row N)``."""
    suffix = _suffix(path)
    if suffix == ".jsonl":
        return f"{path}:{index + 1}"
    if suffix == ".csv":
        return f"{path}:{index + 2}"
    return f"{path} (row {index + 1})"


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so a huge bad value still gives a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_detail(exc: BaseException) -> str:
    """The first line of the innermost message in ``exc``'s cause chain (datasets wraps the real error in a
    generic one); the type name when no exception in the chain has a message (e.g. StopIteration)."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 16:
        chain.append(chain[-1].__cause__)
    for error in reversed(chain):
        text = str(error).strip()
        if text:
            return text.splitlines()[0]
    return type(exc).__name__


Call = tuple[str, Any]  # a tool call as data: (function name, arguments as parsed JSON)


def normal_call(call: Any) -> Call | None:
    """A call in any of the accepted shapes as (name, arguments); arguments given as a JSON string are parsed.
    None when ``call`` is not a call."""
    if not isinstance(call, dict):
        return None
    if isinstance(call.get("function"), dict):
        call = call["function"]
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return None
    if "arguments" in call:
        arguments = call["arguments"]
    elif "parameters" in call:
        arguments = call["parameters"]
    else:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return name, arguments


def reference_calls(message: dict[str, Any]) -> str | None:
    """The ``calls`` stored for an eval row whose last assistant turn is ``message``: its tool calls as JSON
    ``[[name, arguments], ...]``; None when it calls no tool."""
    functions = [call.get("function", call) if isinstance(call, dict) else call for call in message.get("tool_calls")
                 or []]  # a call written without arguments takes none
    calls = [normal_call({"arguments": {}, **function}) if isinstance(function, dict) else None
             for function in functions]
    found = [call for call in calls if call is not None]
    return json.dumps([list(call) for call in found], sort_keys=True) if found else None


def tools_of(row: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """A row's ``tools`` (JSON schemas of the functions the model may call, as the chat template takes them): a
    list of objects, or a JSON string holding one (as LLaMA-Factory stores them); None when the row has none. One
    DataError line naming ``where`` otherwise."""
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise DataError(f"{where}: field 'tools' is a string but not JSON ({exc}); give a list of tool "
                            "schemas") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise DataError(f"{where}: field 'tools' must be a list of tool schemas ({{type: function, function: {{name, "
                        f"description, parameters}}}}), got {short_repr(tools)}")
    return tools or None


def check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's ``tool_calls``: a non-empty list of ``{type: function, function: {name, arguments}}``
    (or ``{name, arguments}``), each name a non-empty string and its arguments an object or a JSON string holding
    one; else one DataError line naming ``where`` (the message) and what to fix."""
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{where}.tool_calls must be a non-empty list of {{type: function, function: {{name, "
                        f"arguments}}}}, got {short_repr(calls)}")
    for k, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise DataError(f"{where}.tool_calls[{k}] needs a function name ({{type: function, function: {{name, "
                            f"arguments}}}}), got {short_repr(call)}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise DataError(f"{where}.tool_calls[{k}] ({name}): arguments are not valid JSON ({exc}); write them "
                                "as an object or a JSON string") from None
        if not isinstance(arguments, dict):
            raise DataError(f"{where}.tool_calls[{k}] ({name}): arguments must be an object (or a JSON string of "
                            f"one), got {short_repr(arguments)}")


def check_turns(value: Any, where: str, name: str = "messages") -> None:
    """``value`` (a row's field ``name``) is a non-empty list of {role, content} messages with a known role and a
    string content, else one DataError naming ``where``, the field and the first bad message. An assistant turn may
    call tools (``tool_calls``, :func:`check_tool_calls`; its content may then be left out) and say ``train:
    false``; a ``tool`` message (a tool's result) must follow a call. Which role may come last is the caller's rule
    (a training chat ends with the answer, a prompt row must not)."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {name!r} must be a non-empty list of {{role, content}}")
    called = False  # a tool's result answers a call made before it
    for i, msg in enumerate(value):
        calls = msg.get("tool_calls") if isinstance(msg, dict) else None
        content = msg.get("content") if isinstance(msg, dict) else None
        # an assistant turn that calls tools may have no content (the OpenAI / transformers shape)
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or not (
                isinstance(content, str) or (content is None and calls is not None and msg["role"] == "assistant")):
            got = {k: msg.get(k) for k in ("role", "content")} if isinstance(msg, dict) else msg
            raise DataError(f"{where}: {name}[{i}] needs role in {ROLES} and a string content, "
                            f"got {short_repr(got)}")
        if calls is not None:
            if msg["role"] != "assistant":
                raise DataError(f"{where}: {name}[{i}] is a {msg['role']} message with tool_calls; only the "
                                "assistant calls tools")
            check_tool_calls(calls, f"{where}: {name}[{i}]")
            called = True
        if msg["role"] == "tool" and not called:
            raise DataError(f"{where}: {name}[{i}] is a tool result with no tool call before it; a tool message "
                            "follows an assistant message with tool_calls")
        train = msg.get("train")
        if train is not None and (not isinstance(train, bool) or (train and msg["role"] != "assistant")):
            raise DataError(f"{where}: {name}[{i}].train must be true or false, on an assistant turn (false keeps "
                            f"it as context only; the other roles are never trained), got {short_repr(train)}")
