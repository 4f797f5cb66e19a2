"""finetune.data.sources: a local data file rewritten with its old modification time is read and tokenized anew
(``datasets`` keys its cache by the mtime alone), and an unchanged one is read from the cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from finetune.data.loading import load_raw
from finetune.data.tokenize import tokenize_rows
from tests.data_files import write_rows


def test_a_rewritten_file_with_its_old_mtime_is_never_served_stale(tmp_path: Path, tok: Any) -> None:
    """datasets keys a local file by its mtime; the same size and mtime with new rows must still be read anew,
    and tokenized anew (the cached tokens of the old rows are not reused)."""
    path = tmp_path / "same.jsonl"
    source = write_rows(path, [{"text": "aaaa"}] * 3)
    before = os.stat(path)
    old = tokenize_rows(load_raw(source), fmt="completion", tokenizer=tok, max_len=32, overlong="truncate",
                        add_bos="auto", source=source)
    write_rows(path, [{"text": "bbbb"}] * 3)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_mtime_ns == before.st_mtime_ns
    raw = load_raw(source)
    assert raw[0]["text"] == "bbbb"
    new = tokenize_rows(raw, fmt="completion", tokenizer=tok, max_len=32, overlong="truncate", add_bos="auto",
                        source=source)
    assert new.dataset[0]["input_ids"] != old.dataset[0]["input_ids"]
    assert new.dataset[0]["input_ids"][1:-1] == tok("bbbb", add_special_tokens=False)["input_ids"]


def test_an_unchanged_file_is_read_from_the_cache(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "same.jsonl", [{"text": "aaaa"}] * 3)
    first = load_raw(source)
    again = load_raw(source)
    assert again.cache_files == first.cache_files
    assert again._fingerprint == first._fingerprint
