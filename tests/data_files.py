"""Small data rows and files shared by the unit tests of the data modules (tests/unit/test_tokenize.py,
test_loading.py, test_formats.py, test_sources.py, test_batched.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_jsonl(path: Path, lines: list[str]) -> str:
    """Write ``lines`` to ``path``, one per line, and return the path as a string (what load_raw takes)."""
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


CHAT_TWO_TURNS = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "First letter of: d r z?"},
    {"role": "assistant", "content": "d"},
    {"role": "user", "content": "First letter of: f b v?"},
    {"role": "assistant", "content": "f"},
]}


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    """Write ``rows`` to ``path`` as JSON lines and return the path as a string (what load_raw takes)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)
