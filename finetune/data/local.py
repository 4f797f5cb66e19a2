"""Local data sources as ``datasets`` reads them: what a path names, which files and splits that is, which rows a
split string picks, and where each of those rows is written (for ``file:line`` errors).

What a path names (:func:`kind`):

- ``saved``: a ``save_to_disk`` folder: a Dataset (``dataset_info.json`` + ``state.json`` + its Arrow files, the one
  split ``train``) or a DatasetDict (``dataset_dict.json``, one sub-folder per split), read with
  ``datasets.load_from_disk``.
- ``folder``: any other folder, e.g. a cloned hub dataset repository: its data files and their splits as
  ``datasets.load_dataset(folder)`` resolves them (:func:`folder_splits`: the README's configs, else the split names
  in file and folder names; files of one type without a split name are the split ``train``).
- ``glob``: a path with ``*``, ``?`` or ``[`` that names no file: the files ``datasets`` matches (hidden files
  aside), all of one type, the one split ``train``.
- ``file``: one file, plain or compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``; its type is the suffix before the
  compression suffix), the one split ``train``.

A source's ``split`` is ``datasets``' own split string (``train``, ``train[:1000]``, ``train[10%:]``,
``train[:50%]+test``): :func:`parts` turns it into row ranges with ``datasets.ReadInstruction``, the same
arithmetic ``load_dataset`` slices with, so a saved folder is sliced exactly as the other kinds.

:class:`Places` says where row ``i`` of such a source is written: ``datasets`` reads a split's files one after the
other in the order it lists them, so the files' row counts (:func:`count_rows`) place a row in its file, and a
slice adds its offset. The counts are taken when a place is first asked for (while tokenizing, or for an error),
and used only when they add up to the split's rows as read; otherwise a row is named ``source (row N)``.

Why the counts are read by hand (:func:`count_rows`: lines, csv records, a JSON list's length, parquet's footer)
rather than from one ``load_dataset`` per file, whose lengths would place the rows for free: measured on 50 small
jsonl files, one load per file took 5.6 s the first time and 10.5 s from the cache (its lookup grows with the cached
configurations), one builder over the folder 0.21 s and 0.03 s; counting the 50 files took 1 ms, and a 100 MiB
jsonl file 0.12 s (0.30 s gzipped).
"""

from __future__ import annotations

import bisect
import bz2
import csv
import gzip
import importlib
import importlib.util
import io
import json
import lzma
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from finetune.config.compose import COMPRESSIONS, WILDCARDS
from finetune.data.rows import data_suffix, error_detail, file_line
from finetune.errors import DataError

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
SAVED_DATASET = ("dataset_info.json", "state.json")  # what save_to_disk writes for a Dataset
SAVED_DICT = "dataset_dict.json"  # ... and for a DatasetDict, beside one sub-folder per split
KINDS = {"saved": "a save_to_disk folder", "folder": "a folder of data files", "glob": "a glob",
         "file": "a file"}
CHUNK = 1 << 22  # bytes read at a time when counting lines


def kind(path: str) -> str | None:
    """What ``path`` names: ``saved``, ``folder``, ``glob`` or ``file`` (see the module's docstring; a missing path
    with a data suffix is a ``file``, which is then not found), or None: a hub dataset name."""
    where = Path(path)
    if where.is_dir():
        return "saved" if saved_kind(path) is not None else "folder"
    if where.exists():
        return "file"
    if any(char in path for char in WILDCARDS):
        return "glob"
    return "file" if data_suffix(path) in BUILDERS else None


def saved_kind(folder: str) -> str | None:
    """``dataset`` or ``dict`` for a folder ``save_to_disk`` wrote (as ``datasets.load_from_disk`` tells them
    apart), else None."""
    if all(Path(folder, name).is_file() for name in SAVED_DATASET):
        return "dataset"
    return "dict" if Path(folder, SAVED_DICT).is_file() else None


def name_of(path: str, subset: str | None, split: str) -> str:
    """How messages name a source: its path, plus the subset and split when they are not the defaults."""
    picked = [f"subset={subset}"] * (subset is not None) + [f"split={split}"] * (split != "train")
    return f"{path} ({', '.join(picked)})" if picked else path


def compression(path: str) -> str | None:
    """The compression suffix of a data file (``.gz`` of ``a.jsonl.gz``), None for a plain one."""
    suffix = Path(path).suffix
    return suffix if suffix in COMPRESSIONS else None


def check_compression(path: str) -> None:
    """Only text files are read compressed (parquet and Arrow compress inside, and ``datasets`` reads them from the
    file as written); a ``.zst`` file needs the optional ``zstandard`` module (``datasets`` decompresses with it
    too)."""
    packed = compression(path)
    if packed is not None and data_suffix(path) in (".parquet", ".arrow"):
        raise DataError(f"{path}: {data_suffix(path)[1:]} files are read as written, not compressed (they compress "
                        f"inside); decompress it, or compress .jsonl/.json/.csv files")
    if packed == ".zst" and importlib.util.find_spec("zstandard") is None:
        raise DataError(f"{path}: reading .zst files needs the zstandard module; pip install zstandard")


def open_data(path: str) -> IO[bytes]:
    """The bytes of a data file as written, decompressed when its suffix says it is compressed."""
    suffix = compression(path)
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    if suffix == ".zst":
        zstandard = importlib.import_module("zstandard")  # optional: check_compression said how to install it
        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115
        return io.BufferedReader(reader)  # lines and readline, which the bare reader lacks
    return open(path, "rb")


def decompression_errors() -> tuple[type[BaseException], ...]:
    """What reading a compressed file that is not what its suffix says (or is cut short) raises: gzip's and bz2's
    OSError, EOFError, zlib's and lzma's errors, zstandard's (when it is installed)."""
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error, lzma.LZMAError]
    if importlib.util.find_spec("zstandard") is not None:
        errors.append(importlib.import_module("zstandard").ZstdError)  # optional
    return tuple(errors)


def undecompressable(path: str, exc: BaseException) -> DataError:
    """The one line for a compressed file that is not what its suffix says (or is cut short)."""
    return DataError(f"{path}: cannot be decompressed as {compression(path)} ({error_detail(exc)}); check the file "
                     "and its suffix")


# ----------------------------------------------------------------------------------------------- files and splits


def glob_files(pattern: str) -> list[str]:
    """The files ``datasets`` matches with ``pattern`` (relative to the working folder), in its order, all of one
    type; none matched, or several types, is one DataError line."""
    from datasets.data_files import resolve_pattern  # lazy: heavy

    try:
        files = resolve_pattern(pattern, base_path=str(Path.cwd()))
    except FileNotFoundError:
        raise DataError(f"{pattern}: no file matches this pattern") from None
    types: dict[str, int] = {}
    for file in files:
        suffix = data_suffix(file)
        name = BUILDERS.get(suffix, suffix or Path(file).name)
        types[name] = types.get(name, 0) + 1
    if len(types) > 1 or not set(types) <= set(BUILDERS.values()):
        found = ", ".join(f"{name}: {count}" for name, count in types.items())
        which = "more than one type" if len(types) > 1 else "a type finetune does not read"
        raise DataError(f"{pattern}: matches files of {which} ({found}); a pattern must match files of one type: "
                        f"{', '.join(sorted(set(BUILDERS.values())))} (compressed too)")
    return files


def builder_of(files: list[str]) -> str:
    """The ``datasets`` builder of files of one type (json, csv, parquet, arrow)."""
    return BUILDERS[data_suffix(files[0])]


def folder_splits(folder: str, builder: Any) -> dict[str, list[str]]:
    """The files of each split of a folder's ``datasets`` builder, in the order it reads them; a folder of files
    finetune does not read (text, images, ...) is one DataError line."""
    splits = {str(name): [str(file) for file in files] for name, files in (builder.config.data_files or {}).items()}
    other = sorted({data_suffix(file) or Path(file).name for files in splits.values() for file in files
                    if data_suffix(file) not in BUILDERS})
    if other:
        raise DataError(f"{folder}: its data files are {', '.join(other)} files; finetune reads folders of "
                        f"{', '.join(BUILDERS)} files (compressed too)")
    return splits


def split_names(spec: str, where: str) -> list[str]:
    """The split names in a split string (``train[:10%]+test`` names train and test); a string ``datasets`` cannot
    parse is one DataError line."""
    from datasets import ReadInstruction  # lazy: heavy

    try:
        instruction = ReadInstruction.from_spec(spec)
    except (ValueError, AssertionError) as exc:
        raise DataError(f"{where}: split {spec!r} is not a split name or a slice of one ({error_detail(exc)}); "
                        "write e.g. train, train[:1000], train[10%:] or train[:50%]") from None
    return [part.splitname for part in instruction._relative_instructions]


def check_splits(spec: str, found: list[str], where: str, what: str) -> None:
    """Every split the split string names is one of ``found`` (the splits of ``where``, ``what`` it is), else one
    DataError line listing the splits there."""
    for name in split_names(spec, where):
        if name not in found:
            if found == ["train"] and what in ("file", "glob"):
                raise DataError(f"{where}: {KINDS[what]} is one split, train, not {name!r}; pick its rows with a "
                                "slice (train[:1000], train[10%:]) or leave split out")
            raise DataError(f"{where}: no split {name!r}; the splits there are {', '.join(found)}")


def parts(spec: str, lengths: dict[str, int]) -> list[tuple[str, int, int]]:
    """The rows a split string picks, as ``(split, start, stop)`` ranges in order, by ``datasets``' own arithmetic
    (``ReadInstruction.to_absolute``: percents rounded to the closest row, ends clamped)."""
    from datasets import ReadInstruction  # lazy: heavy

    return [(part.splitname, part.from_, part.to)
            for part in ReadInstruction.from_spec(spec).to_absolute(lengths)]


def whole(picked: list[tuple[str, int, int]], lengths: dict[str, int]) -> bool:
    """Whether the ranges are exactly the whole split ``train``."""
    return picked == [("train", 0, lengths.get("train", -1))]


def saved_stamp(folder: str) -> list[list[Any]]:
    """Name, size, mtime and ctime of each file a save_to_disk folder holds (not the ``cache-*.arrow`` files that
    ``map`` writes beside them, tokenizing included): what decides its rows, for the tokenized cache's key."""
    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file() and not entry.name.startswith("cache-"):
            info = entry.stat()
            found.append([entry.name, info.st_size, info.st_mtime_ns, info.st_ctime_ns])
    return found


# --------------------------------------------------------------------------------------------------- row places


def count_rows(path: str) -> int | None:
    """The rows ``datasets`` reads from one data file, counted without building them: parquet's footer, the Arrow
    batches' lengths, csv records after the header (blank lines skipped, as pandas does), a JSON list's items, and
    else the lines of JSON lines (blank ones are refused before reading). None when the file cannot be counted."""
    suffix = data_suffix(path)
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq  # lazy: heavy

            return pq.ParquetFile(path).metadata.num_rows
        if suffix == ".arrow":
            return _arrow_rows(path)
        if suffix == ".csv":
            with io.TextIOWrapper(open_data(path), encoding="utf-8-sig", newline="") as handle:
                reader = csv.reader(handle)
                next(reader, None)
                return sum(1 for cells in reader if cells)
        if suffix in (".json", ".jsonl"):
            return _json_rows(path)
    except Exception:  # a file that cannot be counted is named as the source's row, never guessed
        return None
    return None


def _arrow_rows(path: str) -> int:
    """Rows of an Arrow stream or file (the two forms ``datasets``' arrow builder reads)."""
    import pyarrow as pa  # lazy: heavy

    with pa.memory_map(path) as source:
        try:
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def _json_rows(path: str) -> int | None:
    """Items of a JSON list, or lines of JSON lines (one object per line; a last line without a newline counts)."""
    with open_data(path) as handle:
        head = handle.read(1 << 16).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head[:1] == b"[":
        with open_data(path) as handle:
            value = json.loads(handle.read().decode("utf-8").removeprefix("\ufeff"))
        return len(value) if isinstance(value, list) else None
    lines, last = 0, b"\n"
    with open_data(path) as handle:
        while chunk := handle.read(CHUNK):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


@dataclass
class Places:
    """Where each row of a source is, when the source is not one whole file: ``places(index)`` is row ``index``'s
    ``file:line`` (csv: after its header; parquet, arrow, JSON lists: ``file (row N)``; a saved split: ``folder
    (row N)``).

    ``picked``: the split string's ranges (:func:`parts`), in the order the rows were read; ``files``: each split's
    files in ``datasets``' reading order (a saved split: its folder); ``lengths``: each split's rows as read, which
    the files' counts must add up to before they are trusted."""

    name: str
    picked: list[tuple[str, int, int]]
    files: dict[str, list[str]]
    lengths: dict[str, int]
    saved: bool = False
    _starts: list[int] = field(init=False, repr=False)
    _file_starts: dict[str, list[int] | None] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        starts, total = [], 0
        for _, start, stop in self.picked:
            starts.append(total)
            total += stop - start
        self._starts = starts

    def __call__(self, index: int) -> str:
        part = bisect.bisect_right(self._starts, index) - 1
        if part < 0:
            return f"{self.name} (row {index + 1})"
        split, start, _ = self.picked[part]
        row = start + index - self._starts[part]
        files = self.files.get(split, [])
        if self.saved and files:
            return f"{files[0]} (row {row + 1})"
        if len(files) == 1:
            return file_line(files[0], row)
        starts = self._counted(split)
        if starts is None:
            return f"{self.name} (row {index + 1})"
        at = bisect.bisect_right(starts, row) - 1
        return file_line(files[at], row - starts[at])

    def _counted(self, split: str) -> list[int] | None:
        """Where each file of ``split`` starts among its rows (counted once), or None when the counts do not add up
        to the rows read."""
        if split not in self._file_starts:
            starts, total = [], 0
            for file in self.files.get(split, []):
                count = count_rows(file)
                if count is None:
                    total = -1
                    break
                starts.append(total)
                total += count
            self._file_starts[split] = starts if starts and total == self.lengths.get(split) else None
        return self._file_starts[split]


# ------------------------------------------------------------------------------------------------------ streaming


def unstreamable(path: str, split: str, name: str) -> str | None:
    """Why ``data.streaming`` cannot read this source (one line), or None. A stream reads one file from a saved
    position or a hub dataset through ``datasets``' streaming; a folder, a glob or a saved folder has no exact
    resumable position there yet, and a slice would be ignored. A compressed file would: the JSON lines reader opens
    the file and seeks to its byte offset for every 64 rows, and a compressed file seeks by decompressing from its
    start (measured: 0.09 s to reach 90 MiB of a gzipped 100 MiB file, so minutes per pass of that file, growing
    with the square of its size)."""
    what = kind(path)
    if what in ("saved", "folder", "glob"):
        return (f"data.streaming reads single files or hub datasets; {name} is {KINDS[what]} (set data.streaming: "
                "false to read it, tokenized ahead)")
    if what == "file" and compression(path) is not None:
        return (f"data.streaming reads single files or hub datasets, uncompressed; {name} is compressed "
                f"({compression(path)}): decompress it, or set data.streaming: false")
    if (what == "file" and split != "train") or any(char in split for char in "[+"):
        return (f"data.streaming reads single files or hub datasets, whole; {name} picks rows with split "
                f"{split!r}: remove the slice, or set data.streaming: false")
    return None
