"""A source's own names for what its format reads: ``columns`` and ``message_keys`` of a data source.

Published datasets name their fields in their own way. A source says which of its columns holds each field its
format reads (``columns: {messages: conversations, text: body}``, as LLaMA-Factory's dataset_info and axolotl's
field mappings say it) and which keys a message of its conversations uses (``message_keys: {role: from, content:
value}``). The source is then read as if it had been written with finetune's names: the columns renamed, every
message of its message-list columns given ``role`` and ``content`` keys (a role value that is no chat role is read
through ShareGPT's speaker table: ``human`` is user, ``gpt`` assistant, see :mod:`finetune.data.shapes`), before any
check or shape sees a row. Everything after that is the same as for a file written with those names.

The mapping changes the dataset's fingerprint (``datasets`` fingerprints a ``map`` by its function and arguments,
the mapping among them; a rename by the new names), so a changed mapping never reuses a tokenized cache made under
another one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetune.data.loading import quiet_datasets
from finetune.data.rows import ROLES
from finetune.data.shapes import SHAREGPT_ROLES
from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

# the fields that hold message lists (after the column renames): their messages get the renamed keys
MESSAGE_FIELDS = ("messages", "conversations", "chosen", "rejected", "prompt", "completion")


def apply(raw: Dataset, columns: dict[str, str], message_keys: dict[str, str], source: str) -> Dataset:
    """``raw`` read with finetune's names (see the module docstring); ``raw`` itself without a mapping. A column
    that is not in the source, or a field that the source already holds under its own name beside the one mapped
    to it, is one DataError line naming the source and the columns it has."""
    if columns:
        names = raw.column_names
        missing = next((column for column in columns.values() if column not in names), None)
        if missing is not None:
            raise DataError(f"{source}: columns maps to {missing!r}, which is not a column of it (it has "
                            f"{', '.join(names) or 'none'})")
        clash = next((field for field, column in columns.items() if field in names and field != column
                      and field not in columns.values()), None)
        if clash is not None:
            raise DataError(f"{source}: columns maps {columns[clash]!r} to {clash!r}, but the source has its own "
                            f"{clash!r} column too; map that one away or drop it")
        raw = raw.rename_columns({column: field for field, column in columns.items() if field != column})
    fields = [name for name in MESSAGE_FIELDS if name in raw.column_names]
    if not message_keys or not fields:
        return raw
    with quiet_datasets():
        return raw.map(rename_keys, batched=True, fn_kwargs={"keys": dict(message_keys), "fields": fields},
                       desc=None)


def rename_keys(batch: dict[str, list[Any]], keys: dict[str, str], fields: list[str]) -> dict[str, list[Any]]:
    """Each message of ``fields`` in a batch with ``role`` and ``content`` read from the source's own keys
    (``keys``: finetune's key -> the source's), its other keys kept; a role value that is no chat role is read
    through ShareGPT's speaker table (one it does not know is left for the row check to name)."""
    out = dict(batch)
    for field in fields:
        out[field] = [value if not isinstance(value, list) else [_message(m, keys) for m in value]
                      for value in batch[field]]
    return out


def _message(message: Any, keys: dict[str, str]) -> Any:
    if not isinstance(message, dict):
        return message
    theirs = set(keys.values())
    out = {key: value for key, value in message.items() if key not in theirs}
    for ours, their in keys.items():
        out[ours] = message.get(their)
    role = out.get("role")
    if isinstance(role, str) and role not in ROLES:
        out["role"] = SHAREGPT_ROLES.get(role, role)
    return out
