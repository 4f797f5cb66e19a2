"""The datasets cache entries finetune reads (finetune.data.cache): a damaged entry of the tokenized split or of the
raw rows is discarded and rebuilt with one note line, never an internal error, never blamed on the intact data
file, never read as if it were the split; a full cache disk is one line naming the cache folder."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from finetune.data.loading import load_raw
from finetune.data.tokenize import Tokenized, tokenize_rows
from finetune.errors import DataError

ROWS = [{"instruction": f"Say {i}.", "output": f"{i} and {i + 1}"} for i in range(2200)]  # 2 Arrow batches a shard


def _source(tmp_path: Path, rows: list[dict[str, str]] = ROWS) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _tokenized(source: str, tok: Any, procs: int, overlong: str = "truncate") -> Tokenized:
    return tokenize_rows(load_raw(source), fmt="alpaca", tokenizer=tok, max_len=128, overlong=overlong,
                         add_bos="auto", source=source, num_proc=procs)


def _replace(path: Path, content: bytes) -> None:
    """``path`` with new bytes, as a new file (a process that maps the old one keeps reading it)."""
    scratch = path.with_name(path.name + ".new")
    scratch.write_bytes(content)
    os.replace(scratch, path)


def _stream(path: Path, table: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    _replace(path, sink.getvalue().to_pybytes())


def truncated(path: Path) -> None:
    _replace(path, path.read_bytes()[: path.stat().st_size // 2])


def garbage(path: Path) -> None:
    _replace(path, b"\x00not arrow" * 100)


def other_columns(path: Path) -> None:
    _stream(path, pa.table({"x": [1, 2, 3]}))


def fewer_rows(path: Path) -> None:
    """Cut at a batch boundary: the stream still reads, with its first batch's rows only."""
    reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    _stream(path, pa.Table.from_batches([reader.read_next_batch()]))


def a_link(path: Path) -> None:
    """A symbolic link to a sound copy of itself elsewhere: a cache entry is a regular file, never read through."""
    copy = path.parent.parent / f"elsewhere-{path.name}"
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)


@pytest.mark.parametrize(("damage", "procs"), [(truncated, 2), (truncated, 1), (garbage, 2), (other_columns, 2),
                                               (fewer_rows, 2), (a_link, 1)],
                         ids=["truncated", "truncated-one-process", "garbage", "other-columns", "fewer-rows", "link"])
def test_a_damaged_tokenized_entry_is_discarded_and_tokenized_again(tmp_path: Path, tok: Any,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    damage: Callable[[Path], None],
                                                                    procs: int) -> None:
    source = _source(tmp_path)
    first = _tokenized(source, tok, procs)
    ids = first.dataset["input_ids"][:]
    entries = sorted({Path(f["filename"]) for f in first.dataset.cache_files if f["filename"].count("/cache-")})
    assert len(entries) == procs and not first.cached
    linked = entries[-1].parent.parent / f"elsewhere-{entries[-1].name}"
    damage(entries[-1])
    kept = linked.read_bytes() if linked.exists() else None
    capsys.readouterr()
    again = _tokenized(source, tok, procs)
    assert again.dataset["input_ids"][:] == ids and not again.cached
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(f"note: the tokenized cache of {source} was damaged ("), notes
    assert entries[-1].name in notes[0] and notes[0].endswith("; discarded it, tokenizing again")
    assert kept is None or linked.read_bytes() == kept  # nothing written through the link
    assert _tokenized(source, tok, procs).cached


def test_every_cache_file_beside_the_rows_damaged_at_once_is_rebuilt(tmp_path: Path, tok: Any) -> None:
    """Rows dropped as over-long (data.overlong: drop) leave the split a selection of the tokenized rows; with every
    ``cache-*.arrow`` of the folder cut in half, the next pass still gives the same samples."""
    source = _source(tmp_path, [*ROWS[:50], {"instruction": "long " * 200, "output": "x"}, *ROWS[50:100]])
    first = _tokenized(source, tok, 1, overlong="drop")
    ids = first.dataset["input_ids"][:]
    assert first.dropped == 1 and len(ids) == 100
    for path in Path(first.dataset.cache_files[0]["filename"]).parent.glob("cache-*.arrow"):
        truncated(path)
    assert _tokenized(source, tok, 1, overlong="drop").dataset["input_ids"][:] == ids


@pytest.mark.parametrize("damage", [truncated, garbage, other_columns, fewer_rows],
                         ids=["truncated", "garbage", "other-columns", "fewer-rows"])
def test_a_damaged_raw_rows_entry_is_read_again_from_the_intact_file(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     damage: Callable[[Path], None]) -> None:
    source = _source(tmp_path)
    damage(Path(load_raw(source).cache_files[0]["filename"]))
    capsys.readouterr()
    assert load_raw(source).to_list() == ROWS
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and notes[0].startswith(f"note: the datasets cache of {source} was damaged ("), notes
    assert load_raw(source).to_list() == ROWS and not capsys.readouterr().err


FULL = [OSError(errno.ENOSPC, "No space left on device"),
        OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")]  # as pyarrow words it


@pytest.mark.parametrize("error", FULL, ids=["errno", "pyarrow"])
@pytest.mark.parametrize("doing", ["reading", "tokenizing"])
def test_a_full_cache_disk_is_one_line_naming_the_cache_folder(tmp_path: Path, tok: Any,
                                                              monkeypatch: pytest.MonkeyPatch, error: OSError,
                                                              doing: str) -> None:
    import datasets  # here, not at collection: huggingface_hub reads HF_HUB_OFFLINE once, when datasets imports it

    source = _source(tmp_path)
    raw = load_raw(source) if doing == "tokenizing" else None

    def full(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "finalize", full)
    with pytest.raises(DataError) as failed:
        if raw is None:
            load_raw(source)
        else:
            tokenize_rows(raw, fmt="alpaca", tokenizer=tok, max_len=128, overlong="truncate", add_bos="auto",
                          source=source, num_proc=1)
    assert str(failed.value) == (
        f"the datasets cache folder {datasets.config.HF_DATASETS_CACHE} is full (no space left on the device) while "
        f"{doing} {source}; free space there, or set HF_DATASETS_CACHE to a folder on a disk with room")


def test_a_damaged_raw_entry_of_a_sliced_folder_is_read_again(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A slice's rows are counted against what the cache recorded of its split (the whole split has more rows than
    the slice, so the count of the split alone would call every slice damaged, and a damaged one sound)."""
    folder = tmp_path / "repo"
    folder.mkdir()
    _source(folder)
    split = "train[100:]"
    assert load_raw(str(folder), split=split).to_list() == ROWS[100:] and not capsys.readouterr().err
    entry = Path(load_raw(str(folder), split=split).cache_files[0]["filename"])
    assert not capsys.readouterr().err  # a sound slice is not damage
    fewer_rows(entry)
    assert load_raw(str(folder), split=split).to_list() == ROWS[100:]
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and notes[0].startswith(f"note: the datasets cache of {folder} was damaged ("), notes
    assert notes[0].endswith("reading its files again")
