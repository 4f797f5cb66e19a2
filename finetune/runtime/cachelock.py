"""The lock that one process fills the data caches under, and the marker that says it did (``finetune-locks/`` beside
the datasets cache, see :mod:`finetune.runtime.prepare`).

The lock is a POSIX record lock (``lockf``), not a ``flock``: a flock belongs to the open file description, which
every forked process inherits, so a tokenizing worker that outlived its killed parent (``datasets``' pool) kept it,
and every later run of the same data waited in silence for ever. A record lock belongs to the process that took it:
its forked workers never hold it, and the kernel drops it when that process dies, SIGKILL included, so a lock is
never held by a dead process. Its one trap: closing any descriptor of the file in the holding process drops it, so
the file is opened once, here, and the holder's record is read only by the processes that wait.

The holder writes who it is into the lock file (pid, host, when it took the lock); a process that waits polls
without blocking and, after :data:`SAY_AFTER_S`, says once per holder on stderr whom it waits for. Where no lock
can be taken (an unwritable cache, a file system without locks) the processes go on unlocked: they then tokenize
side by side, which is correct, only slower.

Neither file is ever written through a link: each is opened without following one, and whatever else stands at its
name (a symbolic link, a hard link, a named pipe) is removed, by name only, and a fresh file made in its place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SAY_AFTER_S = 3.0  # a wait longer than this says whom it waits for
POLL_S = 0.2  # how often a waiting process tries the lock again
HELD = (errno.EACCES, errno.EAGAIN)  # what lockf raises while another process holds the lock
_NOBODY = object()  # no holder said yet


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as it wrote itself into the lock file."""

    pid: int
    host: str
    since: float  # time.time() when it took the lock

    @classmethod
    def read(cls, fd: int) -> Holder | None:
        """The record in the lock file open at ``fd``; None while there is none (the holder has not written it yet,
        or an older finetune holds the file)."""
        try:
            record = json.loads(os.pread(fd, 4096, 0))
            return cls(int(record["pid"]), str(record["host"]), float(record["since"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def words(self) -> str:
        """``pid N (running since HH:MM:SS)``, with the host when it is another machine (a shared cache)."""
        where = "" if self.host == socket.gethostname() else f" on {self.host}"
        return f"pid {self.pid}{where} (running since {time.strftime('%H:%M:%S', time.localtime(self.since))})"


def _kind(mode: int, links: int) -> str | None:
    """What stands at a name instead of finetune's own file, in words; None for a regular file with one name."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    return f"a hard link ({links} names)" if links > 1 else None


def own_file(path: Path) -> int:
    """A read-write descriptor of ``path`` as finetune's own file: a regular file with one name, created if missing,
    opened without following a link. Anything else at the name is removed (the name only: nothing is written
    through it) with a one-line note, and the file made fresh. A folder there raises (OSError)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks
    for _ in range(3):  # another process may plant or replace the name between two tries
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # ELOOP: a symbolic link, which O_NOFOLLOW refuses
                raise
            info = os.lstat(path)
        else:
            info = os.fstat(fd)
            if _kind(info.st_mode, info.st_nlink) is None:
                return fd
            os.close(fd)
        print(f"note: {path} was {_kind(info.st_mode, info.st_nlink)}, not finetune's own file; replaced it with a "
              "fresh one (nothing was written through it)", file=sys.stderr, flush=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    raise OSError(errno.EEXIST, "kept being replaced while it was opened", str(path))


def is_done(marker: Path) -> bool:
    """Whether the marker that the caches were filled is there (finetune's own file; a link there counts as not)."""
    try:
        info = os.lstat(marker)
    except OSError:
        return False
    return _kind(info.st_mode, info.st_nlink) is None


def mark_done(marker: Path) -> None:
    """Leave the marker (an empty file of finetune's own). A cache folder that cannot be written to leaves none: the
    next process then fills the caches under the lock again and finds them warm."""
    with contextlib.suppress(OSError):
        os.close(own_file(marker))


def _say(path: Path, what: str, holder: Holder | None) -> None:
    by = holder.words() if holder else "another process"
    print(f"waiting for the tokenization of {what} by {by}; it holds {path}", file=sys.stderr, flush=True)


def _take(path: Path, what: str) -> int | None:
    """Wait for the lock on ``path`` and take it; its descriptor, or None where no lock can be taken."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = own_file(path)
    except OSError:
        return None
    started, said = time.monotonic(), _NOBODY
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in HELD:  # a file system without locks: go on unlocked
                    os.close(fd)
                    return None
            holder = Holder.read(fd)
            if time.monotonic() - started >= SAY_AFTER_S and holder != said:
                _say(path, what, holder)
                said = holder
            time.sleep(POLL_S)
    except BaseException:  # Ctrl+C or a stop signal while waiting
        os.close(fd)
        raise
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": what})
    with contextlib.suppress(OSError):  # a full disk: the lock holds all the same, without its record
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
    return fd


@contextlib.contextmanager
def held(path: Path, what: str) -> Iterator[None]:
    """Hold the lock on ``path`` for the block, waiting for it while another process holds it (``what``: the data
    being tokenized, for the line that says whom a long wait is for)."""
    fd = _take(path, what)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # drops the lock (so does this process dying)
