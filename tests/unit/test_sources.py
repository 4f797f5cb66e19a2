"""finetune.data.sources: a local data file rewritten with its old modification time is read and tokenized anew
(``datasets`` keys its cache by the mtime alone), and an unchanged one is read from the cache; the same for a file
of a folder or a glob, a compressed file, and a saved folder, and another slice or split is never served the rows
or tokens of the one before."""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path
from typing import Any

import datasets

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


def test_a_rewritten_file_with_other_rows_and_its_old_mtime_is_read(tmp_path: Path) -> None:
    """The cache's recorded row count of the old file is no expectation for the new one (datasets refused the new
    count as "non-matching split sizes")."""
    path = tmp_path / "rows.jsonl"
    source = write_rows(path, [{"text": "a"}])
    assert load_raw(source)["text"][:] == ["a"]
    before = os.stat(path)
    write_rows(path, [{"text": "b"}, {"text": "c"}])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert load_raw(source)["text"][:] == ["b", "c"]


def test_an_unchanged_file_is_read_from_the_cache(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "same.jsonl", [{"text": "aaaa"}] * 3)
    first = load_raw(source)
    again = load_raw(source)
    assert again.cache_files == first.cache_files
    assert again._fingerprint == first._fingerprint


# ------------------------------------------------- sources of several files, compressed files, slices, splits


def _tokens(raw: Any, tok: Any, source: str) -> list[list[int]]:
    out = tokenize_rows(raw, fmt="completion", tokenizer=tok, max_len=32, overlong="truncate", add_bos="auto",
                        source=source)
    return [list(ids) for ids in out.dataset["input_ids"]]


def _keep_times(path: Path, before: os.stat_result) -> None:
    """Put the file's old mtime back (as ``cp -p`` or ``rsync -t`` would)."""
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_file_of_a_folder_rewritten_with_its_old_mtime_is_read_and_tokenized_anew(tmp_path: Path,
                                                                                   tok: Any) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    write_rows(folder / "train-a.jsonl", [{"text": "aaaa"}] * 2)
    changed = folder / "train-b.jsonl"
    write_rows(changed, [{"text": "bbbb"}] * 2)
    old = _tokens(load_raw(str(folder)), tok, str(folder))
    before = os.stat(changed)
    write_rows(changed, [{"text": "cccc"}] * 2)
    _keep_times(changed, before)
    raw = load_raw(str(folder))
    assert raw["text"][:] == datasets.load_dataset(str(folder), split="train", download_mode="force_redownload")[
        "text"][:] == ["aaaa", "aaaa", "cccc", "cccc"]
    new = _tokens(raw, tok, str(folder))
    assert new[:2] == old[:2] and new[2] != old[2]
    assert new[2][1:-1] == tok("cccc", add_special_tokens=False)["input_ids"]


def test_a_file_added_to_a_glob_is_read(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", [{"text": "a"}])
    pattern = str(tmp_path / "*.jsonl")
    assert load_raw(pattern)["text"][:] == ["a"]
    write_rows(tmp_path / "b.jsonl", [{"text": "b"}])
    assert load_raw(pattern)["text"][:] == ["a", "b"]


def test_a_rewritten_compressed_file_with_its_old_mtime_is_read_anew(tmp_path: Path) -> None:
    """A compressed file is keyed by its own stamp, as a plain one: new rows under the old mtime are read."""
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "old"}\n'))
    assert load_raw(str(path))["text"][:] == ["old"]
    before = os.stat(path)
    path.write_bytes(gzip.compress(b'{"text": "new"}\n{"text": "rows"}\n'))
    _keep_times(path, before)
    assert load_raw(str(path))["text"][:] == ["new", "rows"]


def test_an_unchanged_folder_is_read_from_the_cache(tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    write_rows(folder / "train.jsonl", [{"text": "a"}])
    write_rows(folder / "test.jsonl", [{"text": "t"}])
    first = load_raw(str(folder), split="test")
    again = load_raw(str(folder), split="test")
    assert again.cache_files == first.cache_files and again._fingerprint == first._fingerprint


def test_another_slice_or_split_is_tokenized_as_its_own_rows(tmp_path: Path, tok: Any) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    write_rows(folder / "train.jsonl", [{"text": f"row {i}"} for i in range(6)])
    write_rows(folder / "test.jsonl", [{"text": "held out"}])
    source = str(folder)
    assert _tokens(load_raw(source, split="train[:3]"), tok, source)[0][1:-1] == \
        tok("row 0", add_special_tokens=False)["input_ids"]
    later = _tokens(load_raw(source, split="train[3:]"), tok, source)
    assert [ids[1:-1] for ids in later] == [tok(f"row {i}", add_special_tokens=False)["input_ids"]
                                            for i in range(3, 6)]
    assert _tokens(load_raw(source, split="test"), tok, source)[0][1:-1] == \
        tok("held out", add_special_tokens=False)["input_ids"]


def test_a_saved_folder_whose_rows_changed_is_tokenized_anew(tmp_path: Path, tok: Any) -> None:
    """The saved folder's own fingerprint (state.json) stays when its Arrow file is replaced by other rows; the
    files' stamps in the rows' fingerprint still give the tokenized cache a new key."""
    saved, other = tmp_path / "saved", tmp_path / "other"
    datasets.Dataset.from_list([{"text": "aaaa"}] * 2).save_to_disk(str(saved))
    datasets.Dataset.from_list([{"text": "bbbb"}] * 2).save_to_disk(str(other))
    old = _tokens(load_raw(str(saved)), tok, str(saved))
    arrow = next(saved.glob("data-*.arrow"))
    shutil.copyfile(next(other.glob("data-*.arrow")), arrow)
    raw = load_raw(str(saved))
    assert raw["text"][:] == datasets.load_from_disk(str(saved))["text"][:] == ["bbbb", "bbbb"]
    new = _tokens(raw, tok, str(saved))
    assert new != old and new[0][1:-1] == tok("bbbb", add_special_tokens=False)["input_ids"]
