"""Load raw rows with Hugging Face ``datasets`` and check them against the recipe's format.

Local jsonl/json/csv/parquet files (and hub dataset names where a network exists) become a ``datasets.Dataset``.
Every row is checked before tokenization so a bad row fails with the file, its 1-based line number and the
field, instead of a KeyError deep inside ``map``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

# format -> (required string fields, optional string fields)
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input",)),
    "completion": (("text",), ()),
    "classification": (("text", "label"), ()),
    "chat": (("messages",), ()),
}
ROLES = ("system", "user", "assistant")


def line_of(path: str, index: int) -> str:
    """Where row ``index`` lives in its file, as ``file:line`` (csv counts its header line)."""
    suffix = Path(path).suffix
    if suffix == ".jsonl":
        return f"{path}:{index + 1}"
    if suffix == ".csv":
        return f"{path}:{index + 2}"
    return f"{path} (row {index + 1})"


def _scan_jsonl(path: str) -> None:
    """Find the first line that is not a JSON object (``datasets`` reports these without a line number)."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                raise DataError(f"{path}:{number}: empty line; remove it (jsonl needs one JSON object per line)")
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(value, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")


def _check_blank_lines(path: str) -> None:
    """A blank line would shift every later row's line number: a fast byte scan, then the exact line if any."""
    if re.search(rb"(?:^|\n)[ \t\r]*(?:\n|[ \t\r]+$)", Path(path).read_bytes()):
        _scan_jsonl(path)  # raises with the line number


def load_raw(source: str) -> Dataset:
    """Load one split's raw rows from a local file or a hub dataset name."""
    import datasets

    suffix = Path(source).suffix
    if suffix in BUILDERS:
        if not Path(source).is_file():
            raise DataError(f"{source}: data file not found")
        if Path(source).stat().st_size == 0:
            raise DataError(f"{source}: no rows (the file is empty)")
        if suffix == ".jsonl":
            _check_blank_lines(source)  # rows must map to lines one to one for file:line errors
        try:
            return datasets.load_dataset(BUILDERS[suffix], data_files=source, split="train")
        except Exception as exc:  # datasets wraps parse errors in several exception types
            if suffix == ".jsonl":
                _scan_jsonl(source)  # find the offending line (only on failure: a full parse costs seconds per 1M rows)
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]  # some (StopIteration) have no message
            raise DataError(f"{source}: cannot be read as {suffix[1:]} ({detail})") from None
    if Path(source).exists():
        raise DataError(f"{source}: unsupported data file type; use one of {', '.join(BUILDERS)}")
    try:
        return datasets.load_dataset(source, split="train")
    except Exception as exc:
        raise DataError(f"{source}: not a local file and cannot be loaded from the hub ({exc})") from None


def _check_messages(value: Any, where: str) -> None:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or not isinstance(msg.get("content"), str):
            raise DataError(f"{where}: messages[{i}] needs role in {ROLES} and a string content")
    if value[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's (it is what the model learns)")


def check_row(row: dict[str, Any], index: int, fmt: str, source: str) -> None:
    """Raise a DataError naming file, line and field when ``row`` (row ``index`` of ``source``) does not fit."""
    required, optional = FIELDS[fmt]
    where = line_of(source, index)
    for name in required:
        value = row.get(name)
        if value is None:
            raise DataError(f"{where}: missing field {name!r} ({fmt} rows need {', '.join(required)})")
        if name == "messages":
            _check_messages(value, where)
        elif name == "label":
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise DataError(f"{where}: field 'label' must be a label name or an integer id, got {value!r}")
        elif not isinstance(value, str) or (name != "input" and not value.strip()):
            raise DataError(f"{where}: field {name!r} must be a non-empty string")
    for name in optional:
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: field {name!r} must be a string")


def check_columns(dataset: Dataset, fmt: str, source: str) -> None:
    """Cheap checks of the whole table: rows exist and the format's columns are there."""
    required, _ = FIELDS[fmt]
    if not len(dataset):
        raise DataError(f"{source}: no rows")
    missing_cols = [f for f in required if f not in dataset.column_names]
    if missing_cols:
        raise DataError(f"{line_of(source, 0)}: missing field {missing_cols[0]!r} "
                        f"({fmt} rows need {', '.join(required)})")


def check_rows(dataset: Dataset, fmt: str, source: str) -> None:
    """Check every row (tokenization does the same row by row inside its cached ``map``)."""
    check_columns(dataset, fmt, source)
    for index, row in enumerate(dataset):
        check_row(row, index, fmt, source)
