"""finetune.data.local: what a path names, the rows a split string picks, the files' row counts and where each row
of a folder, glob or slice is written; a stream refuses what it cannot resume exactly.

The references are ``datasets``' own: ``load_dataset`` with the same split string for the slices, the length of what
it reads for the counts, ``save_to_disk`` for the saved folders."""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import json
import lzma
from pathlib import Path
from typing import Any

import datasets
import pytest

from finetune.data import local
from finetune.errors import DataError

OPENERS = {"": open, ".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def _jsonl(path: Path, texts: list[str]) -> str:
    """Rows ``{"text": t}`` as JSON lines, compressed as the suffix says."""
    with OPENERS.get(path.suffix if path.suffix in OPENERS else "", open)(path, "wt") as handle:
        handle.write("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def _split_folder(tmp_path: Path) -> str:
    """A folder with a train split of two files (one compressed) and a test split, as a cloned hub repo has."""
    folder = tmp_path / "repo"
    folder.mkdir()
    _jsonl(folder / "train-a.jsonl", [f"a{i}" for i in range(4)])
    _jsonl(folder / "train-b.jsonl.gz", [f"b{i}" for i in range(3)])
    _jsonl(folder / "test.jsonl", [f"t{i}" for i in range(3)])
    return str(folder)


# --------------------------------------------------------------------------------------------- what a path is


def test_kind_tells_every_source_apart(tmp_path: Path) -> None:
    rows = datasets.Dataset.from_list([{"text": "a"}])
    rows.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=rows).save_to_disk(str(tmp_path / "saved_dict"))
    folder = _split_folder(tmp_path)
    file = _jsonl(tmp_path / "x.jsonl.gz", ["a"])
    assert local.kind(str(tmp_path / "saved")) == "saved" and local.saved_kind(str(tmp_path / "saved")) == "dataset"
    assert local.kind(str(tmp_path / "saved_dict")) == "saved"
    assert local.saved_kind(str(tmp_path / "saved_dict")) == "dict"
    assert local.kind(folder) == "folder" and local.saved_kind(folder) is None
    assert local.kind(f"{folder}/train-*") == "glob"
    assert local.kind(file) == "file"
    assert local.kind(str(tmp_path / "missing.jsonl.bz2")) == "file"  # then "not found"
    assert local.kind("org/dataset") is None  # a hub name


def test_a_file_whose_name_looks_like_a_glob_is_a_file(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "rows[1].jsonl", ["a"])
    assert local.kind(path) == "file"


# ---------------------------------------------------------------------------------------------- split strings


@pytest.mark.parametrize("spec", ["train", "test", "train[:3]", "train[2:]", "train[10%:]", "train[:50%]",
                                  "train[-2:]", "train[:33%]+test", "test[1:]+train[:1]", "train[50:]"])
def test_parts_pick_the_rows_load_dataset_picks(tmp_path: Path, spec: str) -> None:
    folder = _split_folder(tmp_path)
    whole = {name: datasets.load_dataset(folder, split=name)["text"][:] for name in ("train", "test")}
    picked = [whole[name][i] for name, start, stop in local.parts(spec, {k: len(v) for k, v in whole.items()})
              for i in range(start, stop)]
    if spec == "train[50:]":  # datasets refuses to build a split of no rows; the range is empty all the same
        assert picked == []
        return
    assert picked == datasets.load_dataset(folder, split=spec)["text"][:]


def test_split_names_and_their_mistakes_are_one_line(tmp_path: Path) -> None:
    assert local.split_names("train[:10%]+test", "src") == ["train", "test"]
    with pytest.raises(DataError) as error:
        local.split_names("train[:", "src")
    assert str(error.value).startswith("src: split 'train[:' is not a split name or a slice of one (")
    assert "\n" not in str(error.value)


def test_a_missing_split_lists_the_splits_there() -> None:
    local.check_splits("train[:5]+test", ["train", "test"], "repo", "folder")
    with pytest.raises(DataError, match=r"^repo: no split 'validation'; the splits there are train, test$"):
        local.check_splits("validation", ["train", "test"], "repo", "folder")
    with pytest.raises(DataError, match=r"^x.jsonl: a file is one split, train, not 'test'; pick its rows with a "
                                        r"slice"):
        local.check_splits("test", ["train"], "x.jsonl", "file")


# ----------------------------------------------------------------------------------------------- files and globs


def test_a_glob_matches_files_of_one_type(tmp_path: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", ["a"])
    b = _jsonl(tmp_path / "b.jsonl.gz", ["b"])
    assert local.glob_files(str(tmp_path / "*.jsonl*")) == [a, b]
    (tmp_path / "notes.md").write_text("hi\n")
    with pytest.raises(DataError) as error:
        local.glob_files(str(tmp_path / "*"))
    message = str(error.value)
    assert message.startswith(f"{tmp_path / '*'}: matches files of more than one type (json: 2, .md: 1); ")
    with pytest.raises(DataError, match=r"no file matches this pattern$"):
        local.glob_files(str(tmp_path / "train-*.parquet"))


@pytest.mark.parametrize("suffix", ["", ".gz", ".bz2", ".xz"])
def test_open_data_gives_the_text_as_written(tmp_path: Path, suffix: str) -> None:
    path = _jsonl(tmp_path / f"rows.jsonl{suffix}", ["a", "b"])
    with local.open_data(path) as handle:
        assert handle.read() == b'{"text": "a"}\n{"text": "b"}\n'


def test_zst_without_zstandard_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name, *a))
    with pytest.raises(DataError, match=r"^x.jsonl.zst: reading \.zst files needs the zstandard module; pip install "
                                        r"zstandard$"):
        local.check_compression("x.jsonl.zst")
    local.check_compression("x.jsonl.gz")  # the others are in the standard library


def test_zst_is_read_when_zstandard_is_there(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    path = tmp_path / "rows.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "a"}\n{"text": "b"}\n'))
    with local.open_data(str(path)) as handle:
        assert handle.readline() == b'{"text": "a"}\n'
    assert local.count_rows(str(path)) == 2


# ------------------------------------------------------------------------------------------------- row counts


def _csv(path: Path) -> str:
    path.write_text('text,label\n"two\nlines",a\n\nplain,b\n')  # a quoted newline and a blank line
    return str(path)


def _json_list(path: Path) -> str:
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}, {"text": "c"}]))
    return str(path)


def _parquet(path: Path) -> str:
    datasets.Dataset.from_list([{"text": str(i)} for i in range(5)]).to_parquet(str(path))
    return str(path)


def _arrow(path: Path) -> str:
    import pyarrow as pa

    table = pa.table({"text": [str(i) for i in range(6)]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=4)  # two batches
    return str(path)


@pytest.mark.parametrize(("make", "builder"), [
    (lambda p: _jsonl(p / "a.jsonl", ["x", "y", "z"]), "json"),
    (lambda p: _jsonl(p / "a.jsonl.bz2", ["x", "y"]), "json"),
    (lambda p: _csv(p / "a.csv"), "csv"),
    (lambda p: _json_list(p / "a.json"), "json"),
    (lambda p: _parquet(p / "a.parquet"), "parquet"),
    (lambda p: _arrow(p / "a.arrow"), "arrow"),
], ids=["jsonl", "jsonl.bz2", "csv", "json-list", "parquet", "arrow"])
def test_count_rows_is_what_datasets_reads(tmp_path: Path, make: Any, builder: str) -> None:
    path = make(tmp_path)
    assert local.count_rows(path) == len(datasets.load_dataset(builder, data_files=path, split="train"))


# ------------------------------------------------------------------------------------------------- row places


def test_places_name_each_rows_file_and_line(tmp_path: Path) -> None:
    """Row i of ``train[2:]+test`` over a two-file train split: its own file's line (the slice's offset counted)."""
    folder = _split_folder(tmp_path)
    train = [f"{folder}/train-a.jsonl", f"{folder}/train-b.jsonl.gz"]
    lengths = {"train": 7, "test": 3}
    places = local.Places("repo", local.parts("train[2:]+test", lengths), {"train": train,
                                                                           "test": [f"{folder}/test.jsonl"]}, lengths)
    assert [places(i) for i in range(8)] == [
        f"{train[0]}:3", f"{train[0]}:4", f"{train[1]}:1", f"{train[1]}:2", f"{train[1]}:3",
        f"{folder}/test.jsonl:1", f"{folder}/test.jsonl:2", f"{folder}/test.jsonl:3"]


def test_places_of_parquet_and_saved_rows_are_row_numbers(tmp_path: Path) -> None:
    a, b = _parquet(tmp_path / "a.parquet"), _parquet(tmp_path / "b.parquet")
    places = local.Places("g", [("train", 0, 10)], {"train": [a, b]}, {"train": 10})
    assert places(7) == f"{b} (row 3)"
    saved = local.Places("s", [("test", 4, 9)], {"test": ["s/test"]}, {"test": 9}, saved=True)
    assert saved(0) == "s/test (row 5)"


def test_places_that_do_not_add_up_name_the_source_row(tmp_path: Path) -> None:
    """Counts that differ from the rows read (a file changed since) are never trusted: the source and its row."""
    a, b = _jsonl(tmp_path / "a.jsonl", ["x", "y"]), _jsonl(tmp_path / "b.jsonl", ["z"])
    places = local.Places("src", [("train", 0, 4)], {"train": [a, b]}, {"train": 4})
    assert places(3) == "src (row 4)"


# -------------------------------------------------------------------------------------------------- streaming


def test_a_stream_refuses_what_it_cannot_resume(tmp_path: Path) -> None:
    folder = _split_folder(tmp_path)
    datasets.Dataset.from_list([{"text": "a"}]).save_to_disk(str(tmp_path / "saved"))
    plain = _jsonl(tmp_path / "plain.jsonl", ["a"])
    for path, split, what in ((folder, "train", "a folder of data files"), (f"{folder}/*.jsonl", "train", "a glob"),
                              (str(tmp_path / "saved"), "train", "a save_to_disk folder")):
        problem = local.unstreamable(path, split, path)
        assert problem == (f"data.streaming reads single files or hub datasets; {path} is {what} (set "
                           "data.streaming: false to read it, tokenized ahead)")
    compressed = f"{folder}/train-b.jsonl.gz"
    assert str(local.unstreamable(compressed, "train", compressed)).startswith(
        f"data.streaming reads single files or hub datasets, uncompressed; {compressed} is compressed (.gz)")
    assert str(local.unstreamable(plain, "train[:10]", "p")).startswith(
        "data.streaming reads single files or hub datasets, whole; p picks rows with split 'train[:10]'")
    assert str(local.unstreamable("org/x", "train[:10%]", "h")).startswith("data.streaming reads single files or "
                                                                          "hub datasets, whole; h picks rows")
    assert local.unstreamable(plain, "train", plain) is None and local.unstreamable("org/x", "test", "h") is None


def test_a_compressed_parquet_or_arrow_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"^x\.parquet\.gz: parquet files are read as written, not compressed"):
        local.check_compression("x.parquet.gz")
    with pytest.raises(DataError, match=r"^x\.arrow\.xz: arrow files are read as written"):
        local.check_compression("x.arrow.xz")
