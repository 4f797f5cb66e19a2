"""Load raw rows with Hugging Face ``datasets`` and check them against the recipe's format.

Local jsonl/json/csv/parquet/arrow files (compressed too), globs of them, folders of them and ``save_to_disk``
folders (:mod:`finetune.data.local`), and hub dataset names where a network exists, become a ``datasets.Dataset``
of the split (and slice) the source names.
Every row is checked before tokenization so a bad row fails with the file, its 1-based line number and the
field, instead of a KeyError deep inside ``map``. Whatever is wrong with a file (not UTF-8, not JSON, not what its
compression suffix says, unreadable, corrupt) becomes one :class:`DataError` line: ``datasets``' own exceptions
name no line and arrive as several log lines plus a traceback, so the cheap checks run first and the expensive
scans that find the line run only after ``datasets`` has failed. A file read before and unchanged since is read
from the ``datasets`` cache; when that entry is damaged (unreadable, or fewer rows than were read), the file is read
into the cache again with a one-line note, never blamed for it (:mod:`finetune.data.cache`).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import logging
import math
import os
import re
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.config.compose import COMPRESSIONS, _file_kind
from finetune.data import cache, local, rows, shapes, sources, vision
from finetune.data.local import BUILDERS, open_data
from finetune.data.rows import check_turns, data_suffix, error_detail, line_of, short_repr, tools_of
from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

TEXT_SUFFIXES = (".jsonl", ".json", ".csv")
CHUNK = 1 << 22  # bytes read at a time when scanning a whole file (a few copies of one chunk are the scans' memory)

# format -> (required string fields, optional string fields)
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input",)),
    "completion": (("text",), ()),  # or {prompt, completion} strings (checked by _check_completion)
    "classification": (("text", "label"), ()),
    "chat": (("messages",), ()),  # or ShareGPT conversations (finetune.data.shapes)
    "preference": (("chosen", "rejected"), ("prompt",)),  # checked by _check_preference (two row forms)
    "vision_chat": (("messages",), ()),  # checked by finetune.data.vision.check_row (image parts, 'images')
}

def _json_kind(value: Any) -> str:
    """How JSON spells the type of a decoded value (for messages about the file as the user wrote it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


# ------------------------------------------------------------------------------------------- file-level checks


def check_regular(source: str) -> None:
    """Refuse a path that exists but is neither a folder nor a regular file (a named pipe, a device such as a link
    to /dev/zero, a socket): reading one blocks or never ends, and "not found" or "unsupported type" would be wrong."""
    try:
        mode = os.stat(source).st_mode
    except (OSError, ValueError):
        return
    if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
        raise DataError(f"{source}: not a regular file ({_file_kind(mode)}); name one {'/'.join(BUILDERS)} file")


def check_file(source: str) -> None:
    """The path names a readable, non-empty regular file (each failure would otherwise surface inside datasets)."""
    path = Path(source)
    if path.is_dir():
        raise DataError(f"{source}: is a directory, not a data file; name one {'/'.join(BUILDERS)} file")
    check_regular(source)
    if not path.exists():
        raise DataError(f"{source}: data file not found")
    try:
        with open(source, "rb"):
            pass
    except OSError as exc:
        raise DataError(f"{source}: cannot be opened ({exc.strerror or exc}); check that it is readable") from None
    if path.stat().st_size == 0:
        raise DataError(f"{source}: no rows (the file is empty)")


def _not_utf8(path: str, offset: int) -> DataError:
    """The error for the first byte at ``offset`` that is not UTF-8, with its line and column (in bytes)."""
    line, line_start, done = 1, 0, 0
    with open_data(path) as handle:
        while done < offset:
            chunk = handle.read(min(CHUNK, offset - done))
            line += chunk.count(b"\n")
            last = chunk.rfind(b"\n")
            if last >= 0:
                line_start = done + last + 1
            done += len(chunk)
        byte = handle.read(1)
    return DataError(f"{path}:{line}: not UTF-8 text (byte 0x{byte.hex()} at column {offset - line_start + 1}, "
                     f"file offset {offset}); save the file as UTF-8")


def _check_utf8(path: str) -> None:
    """Refuse a text file that is not UTF-8 (a leading UTF-8 BOM is fine).

    ``datasets`` reports a bad byte without its place (csv, json lists) or, for JSON lines, accepts it and fails
    later while reading a row. The decode runs in chunks, at about the speed of reading the file.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open_data(path) as handle:
        head = handle.read(2)
    if head in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
        raise DataError(f"{path}: not UTF-8 text (it starts with a UTF-16 byte order mark); save the file as UTF-8")
    with open_data(path) as handle:  # opened again: a decompressing reader may not seek back
        while True:
            chunk = handle.read(CHUNK)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:  # exc.object is the decoder's carried-over bytes + this chunk
                raise _not_utf8(path, offset + len(chunk) - len(exc.object) + exc.start) from None
            if not chunk:
                return
            offset += len(chunk)


def _head(path: str) -> bytes:
    """The file's first bytes, without a UTF-8 BOM and leading whitespace (enough to tell its JSON shape)."""
    with open_data(path) as handle:
        return handle.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip()


def _read_all(path: str) -> bytes:
    """The whole file's bytes (decompressed)."""
    with open_data(path) as handle:
        return handle.read()


def _text(path: str) -> io.TextIOWrapper:
    """The file as UTF-8 text for the csv module (a BOM skipped, newlines as written; decompressed)."""
    return io.TextIOWrapper(open_data(path), encoding="utf-8-sig", newline="")


FIRST_BYTE_KIND = {b'"': "a string", b"[": "a list", b"t": "true/false", b"f": "true/false", b"n": "null",
                   **{bytes([c]): "a number" for c in b"-0123456789"}}


def _check_json_top(path: str) -> None:
    """A .json file must hold a list of objects or one object per line; ``datasets`` silently reads a list of
    strings or numbers as a column named ``text``, and fails on a scalar with a message that says neither."""
    head = _head(path)
    first = head[:1]
    if first == b"{":
        return
    if first == b"[":
        item = head[1:].lstrip()[:1]
        if item == b"]":
            raise DataError(f"{path}: no rows (the JSON list is empty)")
        if item in FIRST_BYTE_KIND:
            raise DataError(f"{path}: expected a list of JSON objects (one per row), but its first item is "
                            f"{FIRST_BYTE_KIND[item]}")
        return
    if first in FIRST_BYTE_KIND:
        raise DataError(f"{path}: expected a list of JSON objects (one per row) or one object per line; the file "
                        f"holds {FIRST_BYTE_KIND[first]}")
    _scan_json(path)  # not JSON at all: raises with the line and column


def _check_jsonl_start(path: str) -> None:
    """JSON lines start with an object; ``datasets`` would read a file starting with ``[`` as one JSON list."""
    head = _head(path)
    if head[:1] != b"{":
        scan_jsonl(path, kinds=False)  # raises for the first line


def _check_blank_lines(path: str) -> None:
    """A blank line would shift every later row's line number: a fast byte scan, then the exact line if any.

    Three patterns anchored on newlines (a blank first line, one between two newlines, a blank last line) scan
    about ten times faster than one pattern that tries every byte as a line start. The file is read ``CHUNK``
    bytes at a time (memory does not grow with the file), each chunk scanned from the last newline of the one
    before, so a blank line across two chunks is seen.
    """
    with open_data(path) as handle:
        first = handle.readline(CHUNK)  # the first line, read on while it is only whitespace so far
        while not first.endswith(b"\n") and re.fullmatch(rb"(?:\xef(?:\xbb\xbf?)?)?[ \t\r]*", first):
            more = handle.readline(CHUNK)
            if not more:
                break
            first += more
    blank = bool(re.match(rb"(?:\xef\xbb\xbf)?[ \t\r]*(?:\n|\Z)", first))
    with open_data(path) as handle:  # opened again: a decompressing reader may not seek back
        data = handle.read(CHUNK)
        carry = b""
        while data and not blank:
            text = carry + data
            blank = bool(re.search(rb"\n[ \t\r]*\n", text))
            carry = text[text.rfind(b"\n"):] if b"\n" in text else b""
            data = handle.read(CHUNK)
    if blank or re.search(rb"\n[ \t\r]+\Z", carry):
        scan_jsonl(path, kinds=False)  # raises with the line number


# ------------------------------------------------------------------------------- scans that find the bad line


def _check_kinds(row: dict[str, Any], where: str, label: str, seen: dict[str, tuple[str, str]]) -> None:
    """Each field keeps one JSON type across rows (null aside): older ``datasets`` cannot load a column that mixes
    e.g. lists and strings, and then names no row; ``seen`` maps a field to its first kind and row."""
    for name, value in row.items():
        if value is None:
            continue
        kind = _json_kind(value)
        first = seen.setdefault(name, (kind, label))
        if first[0] != kind:
            raise DataError(f"{where}: field {name!r} is {kind} here but {first[0]} on {first[1]}; "
                            "a field must have one type in every row")


def scan_jsonl(path: str, kinds: bool = True) -> None:
    """Find the first line that is not a JSON object, or not UTF-8 (``datasets`` names no line for either); with
    ``kinds``, also a field whose type differs from earlier lines (only worth reporting once ``datasets`` failed)."""
    seen: dict[str, tuple[str, str]] = {}
    with open_data(path) as handle:  # binary: lines end at \n only, as for datasets, whatever \r they hold
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                _check_utf8(path)  # raises with line, column and offset
                raise DataError(f"{path}:{number}: not UTF-8 text; save the file as UTF-8") from None
            if number == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 BOM, which datasets accepts too
            if not line.strip():
                raise DataError(f"{path}:{number}: empty line; remove it (jsonl needs one JSON object per line)")
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(value, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {_json_kind(value)}")
            if kinds:
                _check_kinds(value, f"{path}:{number}", f"line {number}", seen)


def _scan_json(path: str) -> None:
    """Find why a .json file cannot be loaded: invalid JSON (line, column), an item that is not an object, or a
    field whose type changes between rows. A file of one object per line is scanned as JSON lines."""
    text = _read_all(path).decode("utf-8", errors="replace").removeprefix("\ufeff")  # UTF-8 checked first
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            scan_jsonl(path)  # several objects: JSON lines
            return
        raise DataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(value, dict):
        return
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a list of JSON objects (one per row); the file holds {_json_kind(value)}")
    seen: dict[str, tuple[str, str]] = {}
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise DataError(f"{line_of(path, index)}: expected a JSON object, got {_json_kind(item)}")
        _check_kinds(item, line_of(path, index), f"row {index + 1}", seen)


def check_header(path: str) -> None:
    """A csv header names each column once: ``datasets`` (pandas) renames a second ``output`` to ``output.1``, so
    the rows silently trained on the first column of that name."""
    with _text(path) as handle:
        try:
            header = next(csv.reader(handle), [])
        except csv.Error:  # left to datasets' own message
            return
    twice = next((name for i, name in enumerate(header) if name in header[:i]), None)
    if twice is not None:
        raise DataError(f"{path}:1: the header names the column {twice!r} twice; give each column its own name")


def _scan_csv(path: str) -> None:
    """Find why a csv file cannot be loaded: no data rows, or a row with more fields than the header (pandas names
    that line, but inside a message about tokenizing, with no file)."""
    rows = 0
    with _text(path) as handle:
        reader = csv.reader(handle)
        try:
            header = next(reader, [])
            for cells in reader:
                if not cells:
                    continue
                rows += 1
                if len(cells) > len(header):
                    raise DataError(f"{path}:{reader.line_num}: {len(cells)} fields but the header has "
                                    f"{len(header)}; quote fields that contain commas")
        except csv.Error:  # e.g. a field over the csv module's size limit: leave the report to datasets' message
            return
    if not rows:
        raise DataError(f"{path}: no rows (the file has only a header line)")


def _json_rows(path: str) -> Iterator[Any]:
    """Rows of a .json/.jsonl file as written (a JSON list, or one value per line)."""
    text = _read_all(path).decode("utf-8").removeprefix("\ufeff")
    if text.lstrip().startswith("["):
        yield from json.loads(text)
        return
    for line in text.split("\n"):
        if line.strip():
            yield json.loads(line)


def raw_values(source: str, field: str) -> Iterator[Any]:
    """``field`` of each row of a local jsonl/json/csv file as written (csv: the cell's text; nothing for other
    sources). Loading converts whole columns (ids read as floats because one is written ``2.0``), so this points
    at the row the user must fix. Only used after a check failed; stops quietly where the file cannot be parsed."""
    suffix = data_suffix(source) if Path(source).is_file() else ""
    try:
        if suffix == ".csv":
            with _text(source) as handle:
                reader = csv.reader(handle)
                header = next(reader, [])
                if field not in header:
                    return
                position = header.index(field)
                for cells in reader:
                    if cells:  # pandas skips blank lines too
                        yield cells[position] if position < len(cells) else None
        elif suffix in (".jsonl", ".json"):
            for row in _json_rows(source):
                yield row.get(field) if isinstance(row, dict) else None
    except (OSError, EOFError, ValueError, csv.Error):
        return


# ------------------------------------------------------------------------------------------------------ loading


@contextmanager
def quiet_datasets(level: int = logging.WARNING) -> Iterator[None]:
    """Inside: no ``datasets`` progress bars ("Generating train split", "Map", "Filter") and none of its log
    records below ``level`` (its info lines), whatever the user's datasets verbosity; both are restored after.

    finetune reports its own data work instead (see :func:`finetune.data.tokenize.tokenize_rows`). Warnings still
    show by default; loading passes CRITICAL because ``datasets`` logs a failure before raising it, and the failure
    is reported once, as a DataError line. ``HF_DATASETS_DISABLE_PROGRESS_BARS=0`` (bars asked for) is respected.
    """
    from datasets import config  # lazy: heavy
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars  # lazy: heavy

    logger = logging.getLogger("datasets")
    previous = logger.level
    logger.setLevel(max(level, logger.getEffectiveLevel()))
    hide_bars = not are_progress_bars_disabled() and config.HF_DATASETS_DISABLE_PROGRESS_BARS is None
    if hide_bars:
        disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(previous)
        if hide_bars:
            enable_progress_bars()


@contextmanager
def say_if_slow(text: str, after_s: float = 5.0) -> Iterator[None]:
    """Print ``text`` on stderr once if the block is still running after ``after_s`` seconds, so long work (a big
    file read into the ``datasets`` cache for the first time) is never silent, while quick work (a cache hit) is."""
    timer = threading.Timer(after_s, lambda: print(text, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _check_cache_error(exc: BaseException, source: str, files: list[str] | tuple[str, ...] = ()) -> None:
    """An OSError about another path than the data file (the datasets cache under an unwritable or broken $HOME,
    HF_HOME or HF_DATASETS_CACHE) is that path's problem: one DataError naming it, not "cannot read the data".
    ``files``: a source's data files besides ``source`` itself (a folder's, a glob's)."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    where = getattr(cause, "filename", None)
    data = {Path(path).resolve() for path in (source, *files)}
    if not isinstance(cause, OSError) or not where or Path(str(where)).resolve() in data:
        return
    raise DataError(f"cannot write the datasets cache at {where} ({cause.strerror or type(cause).__name__}) while "
                    f"loading {source}; make $HOME writable, or set HF_DATASETS_CACHE (or HF_HOME) to a writable "
                    "folder") from None


def check_data_file(path: str) -> None:
    """The cheap checks of one local data file before ``datasets`` reads it, each failure one line naming the file
    (and the line to blame): it exists, is readable and not empty; text is UTF-8; JSON lines start with an object
    and have no blank line (rows must map to lines one to one for file:line errors); a .json file holds objects; a
    csv header names each column once. A compressed file is checked as the text it decompresses to."""
    suffix = data_suffix(path)
    check_file(path)
    local.check_compression(path)
    with _decompressing(path):
        if suffix in TEXT_SUFFIXES:
            _check_utf8(path)
        if suffix == ".jsonl":
            _check_jsonl_start(path)
            _check_blank_lines(path)
        elif suffix == ".json":
            _check_json_top(path)
        elif suffix == ".csv":
            check_header(path)


def _scan_failed(path: str) -> None:
    """After ``datasets`` failed to read ``path``: find the line to blame, if the file's type has a scan (a full
    parse costs seconds per 1M rows, so only on failure); returns when it finds nothing."""
    suffix = data_suffix(path)
    with _decompressing(path):
        if suffix == ".jsonl":
            scan_jsonl(path)
        elif suffix == ".json":
            _scan_json(path)
        elif suffix == ".csv":
            _scan_csv(path)


@contextmanager
def _decompressing(path: str) -> Iterator[None]:
    """A check or scan of ``path``'s text: a compressed file that fails to decompress is one line naming it
    (:func:`finetune.data.local.undecompressable`); a DataError, or an error of a plain file, goes on as it is."""
    try:
        yield
    except DataError:
        raise
    except local.decompression_errors() as exc:
        if local.compression(path) is None:
            raise
        raise local.undecompressable(path, exc) from None


def _builder(source: str, what: str, subset: str | None) -> tuple[Any, dict[str, list[str]]]:
    """The ``datasets`` builder of a local file, glob or folder (as ``load_dataset`` makes it, nothing read yet)
    and the files of each of its splits in the order it reads them; a folder or glob that names no readable data
    is one DataError line."""
    import datasets  # lazy: heavy

    try:
        with quiet_datasets(logging.CRITICAL):
            if what == "folder":
                builder = datasets.load_dataset_builder(source, name=subset)
                return builder, local.folder_splits(source, builder)
            files = local.glob_files(source) if what == "glob" else [source]
            return datasets.load_dataset_builder(local.builder_of(files),
                                                 data_files=files if what == "glob" else source), {"train": files}
    except DataError:
        raise
    except FileNotFoundError as exc:  # datasets' EmptyDatasetError, DataFilesNotFoundError
        raise DataError(f"{source}: holds no data files datasets can read ({error_detail(exc)}); a folder needs "
                        f"{', '.join(BUILDERS)} files (compressed too)") from None
    except Exception as exc:
        detail = error_detail(exc)
        mine = local.glob_files(source) if what == "glob" else \
            [str(path) for path in Path(source).rglob("*")] if what == "folder" else []  # only when it failed
        _check_cache_error(exc, source, mine)  # a path that is none of the data's: the datasets cache's fault
        if subset is not None and "BuilderConfig" in detail:
            raise DataError(f"{source}: no subset {subset!r} ({detail})") from None
        raise DataError(f"{source}: cannot be read as {local.KINDS[what]} ({detail})") from None


def _prepare(builder: Any, source: str, split: str, mode: str | None) -> Dataset:
    """What ``datasets.load_dataset`` does with a builder: read its files into the cache (``mode``: the
    download_mode, None to reuse the cache), then give the split string's rows. A slice that picks none of a split's
    rows is one DataError line (``datasets`` fails on it with "an empty table")."""
    from datasets.utils.info_utils import is_small_dataset  # lazy: heavy

    if mode == "force_redownload" and Path(builder.cache_dir, "dataset_info.json").is_file():
        # the builder took the split sizes its cache recorded as what to expect; the files changed since, so a new
        # row count was refused as "NonMatchingSplitsSizes" (a file rewritten with its old mtime and other rows)
        builder.info.splits = None
    with quiet_datasets(logging.CRITICAL), say_if_slow(f"loading {source} ..."), cache.writes(source, "reading"):
        builder.download_and_prepare(download_mode=mode, verification_mode="basic_checks")
        lengths = {name: info.num_examples for name, info in (builder.info.splits or {}).items()}
        named = local.split_names(split, source)
        if all(name in lengths for name in named) and sum(lengths[name] for name in named) \
                and not sum(stop - start for _, start, stop in local.parts(split, lengths)):
            counts = ", ".join(f"{lengths[n]} in {n}" for n in named)
            raise DataError(f"{source}: split {split!r} picks no rows (of {counts}); widen the slice")
        return builder.as_dataset(split=split, in_memory=is_small_dataset(builder.info.dataset_size))


def _from_cache(builder: Any, source: str, split: str, what: str) -> Dataset | None:
    """The rows of ``source`` from the datasets cache, which holds these very files (read before, unchanged since):
    so a failure to read them, or a count that differs from the one recorded, is the cache's damage, never the
    files'. None then, after a one-line note: the caller reads the files again into the cache."""
    try:
        raw = _prepare(builder, source, split, None)
        problem = cache.missing_rows(raw, split)
    except DataError:
        raise
    except Exception as exc:
        problem = error_detail(exc)
    if problem is None:
        return raw
    again = "the file" if what == "file" else "its files"
    print(f"note: the datasets cache of {source} was damaged ({problem}); discarded it, reading {again} again",
          file=sys.stderr, flush=True)
    return None


def _load_files(source: str, what: str, subset: str | None, split: str, name: str) -> Dataset:
    """One split string's rows of a local file, glob or folder (:mod:`finetune.data.local`), read as
    ``load_dataset`` reads them, each file checked first; the datasets cache is used only while no file has changed
    (:mod:`finetune.data.sources`), and each row's place is said for errors when it is not row i of one file."""
    if what == "file" and Path(source).exists() and data_suffix(source) not in BUILDERS:
        raise DataError(f"{source}: unsupported data file type; use one of {', '.join(BUILDERS)} (or one of them "
                        f"compressed: {', '.join(COMPRESSIONS)})")
    if what == "file":
        check_data_file(source)  # before datasets is asked anything: a missing file is "not found", not datasets'
    if subset is not None and what != "folder":
        raise DataError(f"{source}: {local.KINDS[what]} has no subsets (a subset names a hub dataset's or a dataset "
                        "folder's configuration); remove subset")
    builder, files = _builder(source, what, subset)
    local.check_splits(split, list(files), source, what)
    every = list(dict.fromkeys(file for split_files in files.values() for file in split_files))
    if what != "file":
        for file in every:  # datasets reads every split's files
            check_data_file(file)
    # the cache keys a file by its mtime alone (a folder's by its files' mtimes): sources reads a changed one again
    read, scope = (sources.stamp(source), "") if what == "file" else (sources.stamps(every), f"\0{what}\0{subset}")
    mode = sources.download_mode(source, read, scope)
    raw = _from_cache(builder, source, split, what) if mode is None else None
    if raw is None:
        if mode is None:  # the cache was damaged: a builder of its own for the new read
            builder, _ = _builder(source, what, subset)
        try:
            raw = _prepare(builder, source, split, "force_redownload")
        except DataError:
            raise
        except Exception as exc:  # datasets wraps parse errors in several exception types
            _check_cache_error(exc, source, every)
            for file in every:
                _scan_failed(file)
            types = "/".join(sorted({data_suffix(file)[1:] for file in every}))
            raise DataError(f"{source}: cannot be read as {types} ({error_detail(exc)})") from None
        sources.remember(source, read, scope)
    lengths = {split_name: info.num_examples for split_name, info in (raw.info.splits or {}).items()}
    picked = local.parts(split, lengths)
    if what != "file" or not local.whole(picked, lengths):
        rows.place(name, local.Places(name, picked, files, lengths))
    return raw


def _load_saved(source: str, split: str, name: str) -> Dataset:
    """One split string's rows of a ``save_to_disk`` folder, read with ``datasets.load_from_disk`` and sliced with
    ``datasets``' own arithmetic. The rows are read in place (no copy, so never stale); their fingerprint, which
    keys the tokenized cache, is made of the folder's own fingerprint, its files' stamps and the slice, so a folder
    saved again, or a slice changed, is tokenized anew."""
    import datasets  # lazy: heavy
    from datasets.fingerprint import Hasher  # lazy: heavy

    try:
        with quiet_datasets(logging.CRITICAL), say_if_slow(f"loading {source} ..."):
            saved = datasets.load_from_disk(source)
    except Exception as exc:
        raise DataError(f"{source}: cannot be read as a folder written by save_to_disk ({error_detail(exc)})") \
            from None
    one = isinstance(saved, datasets.Dataset)
    splits = {"train": saved} if one else dict(saved)
    local.check_splits(split, list(splits), source, "saved")
    folders = {split_name: source if one else str(Path(source, split_name)) for split_name in splits}
    lengths = {split_name: len(rows_of) for split_name, rows_of in splits.items()}
    picked = local.parts(split, lengths)
    pieces = [splits[part].select(range(start, stop), new_fingerprint=Hasher.hash(
        [splits[part]._fingerprint, local.saved_stamp(folders[part]), part, start, stop]))
        for part, start, stop in picked]
    try:
        raw = pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)
    except ValueError as exc:
        raise DataError(f"{source}: the splits of {split!r} cannot be joined ({error_detail(exc)})") from None
    rows.place(name, local.Places(name, picked, {part: [folders[part]] for part in splits}, lengths, saved=True))
    return _writable(raw, source)


def _writable(raw: Dataset, source: str) -> Dataset:
    """``raw`` where tokenizing can write its cache: ``map`` writes beside the rows' files (as it does for anyone
    who maps a saved dataset), so the rows of a folder that cannot be written to are copied once into the datasets
    cache, under their fingerprint."""
    files = raw.cache_files
    if not files or os.access(Path(files[0]["filename"]).parent, os.W_OK):
        return raw
    from datasets import config  # lazy: heavy

    home = Path(config.HF_DATASETS_CACHE) / "finetune-saved"
    with quiet_datasets(), say_if_slow(f"copying {source} into the datasets cache ..."), \
            cache.writes(source, "copying"):
        home.mkdir(parents=True, exist_ok=True)
        return raw.flatten_indices(cache_file_name=str(home / f"{raw._fingerprint}.arrow"),
                                   new_fingerprint=raw._fingerprint)


def load_raw(source: str, subset: str | None = None, split: str = "train") -> Dataset:
    """Load a source's rows: a local file (plain or compressed), a glob, a folder of data files, a ``save_to_disk``
    folder (:mod:`finetune.data.local`), or a hub dataset name. ``subset``: a hub dataset's (or a folder's)
    configuration; ``split``: ``datasets``' split string, a split's name or a slice of it (``train[:1000]``,
    ``train[10%:]``); a file or a glob is the one split ``train``."""
    import datasets  # lazy: heavy

    check_regular(source)
    name = local.name_of(source, subset, split)
    rows.place(name, None)
    what = local.kind(source)
    if what == "saved":
        if subset is not None:
            raise DataError(f"{source}: a save_to_disk folder has no subsets; remove subset")
        return _load_saved(source, split, name)
    if what is not None:
        return _load_files(source, what, subset, split, name)
    chosen = [f"subset {subset!r}"] * (subset is not None) + [f"split {split!r}"] * (split != "train")
    picked = f" ({', '.join(chosen)})" if chosen else ""
    try:
        with quiet_datasets(logging.CRITICAL), say_if_slow(f"loading {source} ..."):
            return datasets.load_dataset(source, name=subset, split=split)
    except Exception as exc:
        raise DataError(f"{source}: not a local file and cannot be loaded from the hub{picked} "
                        f"({error_detail(exc)})") from None


# ------------------------------------------------------------------------------------------------------ row checks


def label_error(value: Any, where: str) -> str | None:
    """Why ``value`` cannot be a classification label (a name or an id >= 0), as the message for row ``where``;
    None when it can. Anything else (lists, objects, floats, true/false, null) is refused, never coerced."""
    if type(value) is str or (type(value) is int and value >= 0):
        return None
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{where}: missing field 'label' (classification rows need text, label)"
    if isinstance(value, bool):
        hint = " (true/false are not label names; use names such as yes/no, or ids 0/1)"
    elif isinstance(value, float) and value.is_integer():
        hint = " (write integer ids without a decimal point)"
    elif isinstance(value, int):
        hint = " (ids count classes from 0)"
    else:
        hint = ""
    return f"{where}: field 'label' must be a label name or an integer id, got {short_repr(value)}{hint}"


def _check_messages(value: Any, where: str, name: str = "messages") -> None:
    check_turns(value, where, name)
    if value[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's (it is what the model learns)")


PREFERENCE_FORMS = ("{prompt, chosen, rejected} strings, {chosen, rejected} message lists, or {prompt, chosen, "
                    "rejected} message lists")
# TRL's unpaired preference shape (KTO): no task of finetune's trains on it
UNPAIRED = ("a {prompt, completion, label} row is an unpaired preference (KTO's shape), which no finetune task "
            "trains on; pair the answers as {prompt, chosen, rejected} for task dpo or reward, or drop 'label' to "
            "train the completions with task sft")


def _turns(messages: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    """(role, content) of each message: what a pair's two conversations must share (loading may add other keys)."""
    return [(m.get("role"), m.get("content")) for m in messages]


def _check_preference(row: dict[str, Any], where: str) -> None:
    """A preference pair: ``{prompt, chosen, rejected}`` strings, ``{chosen, rejected}`` conversations that differ
    only in their final assistant turn, or ``{prompt, chosen, rejected}`` message lists (the explicit prompt, read
    as the conversations it makes: :func:`finetune.data.shapes.explicit_pair`). The two answers must differ (an
    identical pair teaches nothing)."""
    if row.get("completion") is not None and row.get("label") is not None:
        raise DataError(f"{where}: {UNPAIRED}")
    row = shapes.explicit_pair(row)
    tools_of(row, where)  # a list of tool schemas, or none
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise DataError(f"{where}: missing field {name!r} (preference rows need {PREFERENCE_FORMS})")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            raise DataError(f"{where}: missing field 'prompt' (string pairs need prompt, chosen, rejected)")
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: field {name!r} must be a non-empty string, got {short_repr(value)}")
        if chosen == rejected:
            raise DataError(f"{where}: 'chosen' and 'rejected' are the same answer; a pair needs two different "
                            "answers")
        return
    if isinstance(chosen, list) and isinstance(rejected, list):
        if prompt is not None:
            raise DataError(f"{where}: field 'prompt' of a pair of message lists must be a message list too (the "
                            f"shared conversation before both answers), got {_json_kind(prompt)}")
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            _check_messages(value, where, name)
        if len(chosen) != len(rejected) or _turns(chosen[:-1]) != _turns(rejected[:-1]):
            differ = next((i for i, (a, b) in enumerate(zip(_turns(chosen[:-1]), _turns(rejected[:-1]), strict=False))
                           if a != b),
                          min(len(chosen), len(rejected)) - 1)
            raise DataError(f"{where}: 'chosen' and 'rejected' must share every message but the last assistant turn "
                            f"(they differ at message {differ}); put the shared conversation in both")
        if _turns(chosen[-1:]) == _turns(rejected[-1:]):
            raise DataError(f"{where}: 'chosen' and 'rejected' end with the same assistant turn; a pair needs two "
                            "different answers")
        return
    raise DataError(f"{where}: 'chosen' and 'rejected' must both be strings or both be message lists, got "
                    f"{_json_kind(chosen)} and {_json_kind(rejected)} (preference rows need {PREFERENCE_FORMS})")


def check_row(row: dict[str, Any], index: int, fmt: str, source: str) -> None:
    """Raise a DataError naming file, line and field when ``row`` (row ``index`` of ``source``) does not fit."""
    required, optional = FIELDS[fmt]
    where = line_of(source, index)
    if fmt == "preference":
        _check_preference(row, where)
        return
    if fmt == "vision_chat":
        vision.check_row(row, where)
        return
    if fmt == "completion" and row.get("text") is None and row.get("completion") is not None:
        _check_completion(row, where)
        return
    if fmt == "chat":
        tools_of(row, where)  # a list of tool schemas, or none
    for name in required:
        value = row.get(name)
        if value is None:
            raise DataError(f"{where}: missing field {name!r} ({fmt} rows need {', '.join(required)})")
        if name == "messages":
            _check_messages(value, where)
        elif name == "label":
            problem = label_error(value, where)
            if problem:
                raise DataError(problem)
        elif not isinstance(value, str) or (name != "input" and not value.strip()):
            raise DataError(f"{where}: field {name!r} must be a non-empty string, got {short_repr(value)}")
    for name in optional:
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: field {name!r} must be a string, got {short_repr(value)}")


def _check_completion(row: dict[str, Any], where: str) -> None:
    """A string prompt-completion row (TRL's shape): ``prompt`` and ``completion`` strings, the completion not
    empty; a ``label`` beside them is an unpaired preference, refused."""
    if row.get("label") is not None:
        raise DataError(f"{where}: {UNPAIRED}")
    for name in ("prompt", "completion"):
        value = row.get(name)
        if not isinstance(value, str) or (name == "completion" and not value.strip()):
            kind = "a string" if name == "prompt" else "a non-empty string"
            raise DataError(f"{where}: field {name!r} of a prompt-completion row must be {kind}, got "
                            f"{short_repr(value)}")


def check_columns(dataset: Dataset, fmt: str, source: str) -> None:
    """Cheap checks of the whole table: rows exist and the format's columns are there (written in the format's own
    fields, or in a shape that gives them: :mod:`finetune.data.shapes`)."""
    required, _ = FIELDS[fmt]
    if not len(dataset):
        raise DataError(f"{source}: no rows")
    names = dataset.column_names
    if {"prompt", "completion", "label"} <= set(names) and "chosen" not in names:
        raise DataError(f"{line_of(source, 0)}: {UNPAIRED}")
    if fmt == "completion" and "text" not in names and {"prompt", "completion"} <= set(names):
        return  # string prompt-completion rows: each checked by _check_completion
    given = shapes.columns(fmt, dataset.column_names)
    missing = [f for f in required if f not in given]
    if missing:
        found = ", ".join(dataset.column_names) or "none"
        also = shapes.alternatives(fmt, missing[0])
        if Path(source).suffix == ".csv":
            raise DataError(f"{source}:1: the header has no column {missing[0]!r}{also} ({fmt} needs columns "
                            f"{', '.join(required)}; the header has {found})")
        raise DataError(f"{line_of(source, 0)}: missing field {missing[0]!r}{also} ({fmt} rows need "
                        f"{', '.join(required)}; the rows have {found})")


def check_rows(dataset: Dataset, fmt: str, source: str) -> None:
    """Check every row, each read as the format's own fields first (tokenization does the same row by row inside
    its cached ``map``)."""
    check_columns(dataset, fmt, source)
    read = shapes.reading(fmt)
    for index, row in enumerate(dataset):
        check_row(shapes.normalize_row(row, read, line_of(source, index)), index, fmt, source)
