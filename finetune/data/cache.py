"""The entries of the ``datasets`` cache that finetune reads: which files a tokenization pass reads and writes, a
damaged one discarded before it is read, a pass that ran told from a cache hit, and a full cache disk named.

A tokenized split is cached as ``cache-<key>.arrow`` (``cache-<key>_<rank>_of_<n>.arrow`` per worker with
``data.num_proc`` > 1) beside the raw rows' cache file. ``datasets`` names the file by a fingerprint it computes,
and reads a file of that name blindly: a truncated one was an internal error, one replaced by another table (other
columns, fewer rows) was read as if it were the split. finetune computes the key itself (:func:`key`: the raw rows'
fingerprint, the batch function, its arguments and the output types) and hands it to ``map``, so it knows the
files before ``map`` reads them: each is checked (:func:`check_entries`: a regular file, readable Arrow, the output
columns and types, one row per input row of its shard) and a damaged one is removed, with a one-line note, so
``map`` tokenizes that part again. The files that were there before the pass also tell whether it ran
(:func:`tokenized_now`): what a row function ticks cannot (a format whose function reports no progress was said to
be read from the cache).

The raw rows' cache (``datasets.load_dataset``) is checked by its own loader (:func:`finetune.data.loading.load_raw`:
a cache that fails to load, or holds fewer rows than ``datasets`` recorded, is read again from the file).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.data import local
from finetune.data.rows import error_detail
from finetune.errors import DataError, _io_cause

if TYPE_CHECKING:
    from datasets import Dataset, Features

FULL = (errno.ENOSPC, errno.EDQUOT)
Entry = tuple[int, int, int, int]  # device, inode, size, mtime: the same file, unchanged


def key(dataset: Dataset, fn: Callable[..., Any], fn_kwargs: dict[str, Any], features: Features) -> str | None:
    """The cache key of ``dataset.map(fn, fn_kwargs=..., features=...)`` as finetune runs it (batched, with indices,
    every input column removed): what decides the output. None where an argument cannot be hashed (``datasets``
    then picks its own key, and nothing is checked before it is read)."""
    from datasets.fingerprint import Hasher  # lazy: heavy

    hasher = Hasher()
    try:
        for part in (dataset._fingerprint, f"{fn.__module__}.{fn.__qualname__}", fn_kwargs, features,
                     dataset.column_names):
            hasher.update(part)
    except Exception:  # an argument dill cannot pickle: datasets warns and keys it at random itself
        return None
    return hasher.hexdigest()


def _files(dataset: Dataset, fingerprint: str) -> Iterator[tuple[Path, int, int]]:
    """Each cache file of ``fingerprint`` beside ``dataset``'s own, with its shard's rank and shard count."""
    if not dataset.cache_files:  # rows in memory: map caches nothing
        return
    folder = Path(dataset.cache_files[0]["filename"]).parent
    pattern = re.compile(rf"cache-{re.escape(fingerprint)}(?:_(\d+)_of_(\d+))?\.arrow")
    with contextlib.suppress(OSError):
        for path in sorted(folder.iterdir()):
            match = pattern.fullmatch(path.name)
            if match:
                yield path, int(match[1] or 0), int(match[2] or 1)


def _rows(total: int, rank: int, shards: int) -> int:
    """Rows of shard ``rank`` of ``shards`` contiguous shards of ``total`` rows (as ``Dataset.shard`` cuts them)."""
    div, mod = divmod(total, shards)
    return div + (rank < mod)


def _damage(path: Path, features: Features, rows: int) -> str | None:
    """What is wrong with the cache file ``path`` of a shard of ``rows`` rows; None when it is sound."""
    import pyarrow as pa  # lazy: heavy

    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
    try:
        with pa.memory_map(str(path)) as source:  # mapped, not read: the check reads the batches' headers only
            table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        return f"unreadable: {error_detail(exc)}"
    if not table.schema.remove_metadata().equals(features.arrow_schema.remove_metadata()):
        return f"other columns ({', '.join(table.schema.names) or 'none'})"
    if table.num_rows != rows:
        return f"{table.num_rows} rows, not {rows}"
    return None


def _entry(path: Path) -> Entry | None:
    with contextlib.suppress(OSError):
        info = os.stat(path)
        return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns
    return None


def check_entries(dataset: Dataset, fingerprint: str | None, features: Features, source: str) -> dict[str, Entry]:
    """The sound cache files of the pass keyed ``fingerprint`` over ``dataset`` (see :func:`tokenized_now`); each
    damaged one is removed first (the name only) and one note line on stderr says which and why, so the pass
    tokenizes those rows again."""
    if fingerprint is None:
        return {}
    sound: dict[str, Entry] = {}
    damaged = []
    for path, rank, shards in _files(dataset, fingerprint):
        why = _damage(path, features, _rows(len(dataset), rank, shards))
        if why is None:
            entry = _entry(path)
            if entry is not None:
                sound[str(path)] = entry
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        damaged.append(f"{path.name}: {why}")
    if damaged:
        print(f"note: the tokenized cache of {source} was damaged ({'; '.join(damaged)}); discarded it, tokenizing "
              "again", file=sys.stderr, flush=True)
    return sound


def tokenized_now(mapped: Dataset, before: dict[str, Entry]) -> bool:
    """Whether ``map`` tokenized (some of) the rows now: a file it returned was not a sound entry before the pass,
    or the rows live in memory (nothing is cached)."""
    files = [item["filename"] for item in mapped.cache_files]
    return not files or any(before.get(name) != _entry(Path(name)) for name in files)


def missing_rows(raw: Dataset, split: str) -> str | None:
    """What is wrong with the raw rows read from the cache: fewer (or more) rows than ``datasets`` recorded when it
    read the file (an Arrow stream cut at a batch boundary still reads); None when they agree or none was recorded.
    ``split``: the split string the rows were read with (a slice, or splits joined with ``+``, count what they
    pick of the recorded splits)."""
    splits = raw.info.splits or {}
    lengths = {name: info.num_examples for name, info in splits.items()}
    try:
        picked = local.parts(split, lengths)
    except ValueError:  # a split that was not recorded
        return None
    recorded = sum(stop - start for _, start, stop in picked) if all(lengths[name] for name, _, _ in picked) else None
    if recorded and recorded != len(raw):
        return f"{len(raw)} rows where {recorded} were read from the file"
    return None


@contextlib.contextmanager
def writes(source: str, doing: str) -> Iterator[None]:
    """Inside, a full disk or quota while ``datasets`` writes its cache (``doing`` ``source``) is one DataError
    line that names the cache folder and how to move it: the generic line named no folder, or blamed the data
    file."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:
        cause = _io_cause(exc)
        if cause is None or cause.errno not in FULL:
            raise
        from datasets import config  # lazy: heavy

        reason = "no space left on the device" if cause.errno == errno.ENOSPC else "disk quota exceeded"
        raise DataError(f"the datasets cache folder {config.HF_DATASETS_CACHE} is full ({reason}) while {doing} "
                        f"{source}; free space there, or set HF_DATASETS_CACHE to a folder on a disk with room") \
            from None
