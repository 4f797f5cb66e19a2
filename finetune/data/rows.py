"""What every data module shares about a row: the chat roles, the label that is never trained on, and how a row's
place and values are named in a one-line error.

The bottom of finetune/data: it imports none of the others, so loading, vision, batching, tokenize and prompts
can all import it without a circle. """

from __future__ import annotations

import functools
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


def check_turns(value: Any, where: str, name: str = "messages") -> None:
    """``value`` (a row's field ``name``) is a non-empty list of {role, content} messages with a known role and a
    string content (an assistant turn may say ``train: false``), else one DataError naming ``where``, the field
    and the first bad message. Which role may come last is the caller's rule (a training chat ends with the answer,
    a prompt row must not)."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {name!r} must be a non-empty list of {{role, content}}")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or not isinstance(msg.get("content"), str):
            got = {k: msg.get(k) for k in ("role", "content")} if isinstance(msg, dict) else msg
            raise DataError(f"{where}: {name}[{i}] needs role in {ROLES} and a string content, "
                            f"got {short_repr(got)}")
        train = msg.get("train")
        if train is not None and (not isinstance(train, bool) or (train and msg["role"] != "assistant")):
            raise DataError(f"{where}: {name}[{i}].train must be true or false, on an assistant turn (false keeps "
                            f"it as context only; the other roles are never trained), got {short_repr(train)}")
