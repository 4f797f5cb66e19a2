"""Whether the ``datasets`` cache of a local data file may be older than the file.

``datasets`` keys the cache of a local file's rows by the file's modification time only, and the tokenized split's
cache follows from the rows' cache file. A file rewritten with its old modification time kept (``cp -p``,
``rsync -t``, ``tar x``, a fixed clock, two writes within the clock's step) was served from the cache with its old
rows. The inode's change time (ctime) moves on every write, and no tool can set it back (setting the modification
time moves it too), so a record of size, mtime and ctime per file, beside the ``datasets`` cache, tells a file
that may have changed: its rows are read again (:func:`download_mode`), and the new rows' cache file gives the
tokenized split a new cache key. An unchanged file costs one ``stat``.

A source of several files (a folder, a glob: :mod:`finetune.data.local`) is recorded the same way, as one record
of every file's stamp (:func:`stamps`) under the source's own key (``scope``: what besides the path picks its
files, such as a folder's subset): a file added, removed or changed makes the whole source read again. A compressed
file is recorded by its own (compressed) stamp, as a plain one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

RECORDS = "finetune-sources"  # folder under the datasets cache


def stamp(source: str) -> list[int]:
    """The file's size, mtime and ctime (taken before it is read, so a write during the read is seen next time)."""
    info = os.stat(source)
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def stamps(files: list[str]) -> dict[str, list[int]]:
    """:func:`stamp` of each of a source's files, by path."""
    return {file: stamp(file) for file in files}


def _record(source: str, scope: str = "") -> Path:
    from datasets import config  # imports datasets (pyarrow, pandas): only once data is really read

    key = hashlib.sha256((str(Path(source).resolve()) + scope).encode()).hexdigest()[:24]
    return Path(config.HF_DATASETS_CACHE) / RECORDS / f"{key}.json"


def download_mode(source: str, now: Any, scope: str = "") -> str | None:
    """``force_redownload`` when the file (:func:`stamp` ``now``; a source of several files: :func:`stamps`) may
    differ from what the cache holds: no record of it, or a size, mtime or ctime moved (or a file came or went)
    since it was last read; else None (the cache is the file)."""
    try:
        recorded = json.loads(_record(source, scope).read_text())
    except (OSError, ValueError):
        return "force_redownload"
    return None if recorded == now else "force_redownload"


def remember(source: str, read: Any, scope: str = "") -> None:
    """Record that the cache holds the file as it was at :func:`stamp` ``read`` (after a successful load); a cache
    folder that cannot be written to records nothing (the next load reads the file again)."""
    path = _record(source, scope)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(read))
        temporary.replace(path)
    except OSError:
        return
