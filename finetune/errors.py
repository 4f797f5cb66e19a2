"""User-facing errors, and the one place that turns an exception into a message and an exit code.

Everything a user can get wrong raises a :class:`FinetuneError`: one line per problem, naming the key, file, row or
flag and the fix. :func:`run_main` (used by the ``finetune`` CLI and by the worker on every rank) prints those lines
as ``error: ...`` and exits with the error's code; tracebacks are shown only with ``FINETUNE_DEBUG=1``. ``assert``
is reserved for our own invariants.

Exit codes: 0 done; 1 an internal error or a failed verification (e.g. ``finetune merge``'s logit check);
2 a user mistake (recipe, data, run dir, flags, I/O such as a full disk); 3 training diverged (non-finite loss or
gradients) or collapsed (a zero gradient at the loss of a model that predicts nothing: the same cause, a learning
rate far too high, and the same fix); 4 an evaluation during a run failed (the run stays resumable, ``final/``
intact); 130 / 143 stopped by SIGINT / SIGTERM after saving a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any


class FinetuneError(Exception):
    """A mistake the user can fix; the message says what and how."""

    exit_code = 2


class ConfigError(FinetuneError):
    """The recipe (YAML, extends, overrides) is invalid."""


class DataError(FinetuneError):
    """A dataset file is missing or holds a bad row."""


class RunDirError(FinetuneError):
    """A run or checkpoint directory is missing, incomplete, in use, or would be overwritten."""


class EvalError(FinetuneError):
    """An evaluation during a run failed (e.g. out of memory); the checkpoints and the export are kept."""

    exit_code = 4


class NonFiniteError(FinetuneError):
    """Training diverged: the loss or the gradients stayed non-finite; nothing was exported."""

    exit_code = 3


class CollapseError(FinetuneError):
    """Training collapsed: the gradient stayed zero at the loss of a uniform prediction (finite numbers, a dead
    model; :mod:`finetune.runtime.collapse`); nothing was exported. Exit code 3 like a divergence: the same cause
    (a learning rate far too high) and the same fix, so a script that retries a diverged run handles it too."""

    exit_code = 3


@contextlib.contextmanager
def unreadable(message: Callable[[str], str]) -> Iterator[None]:
    """Whatever a library raises on bad bytes while reading a checkpoint (torch, safetensors, DeepSpeed, and DCP,
    whose CheckpointException is no Exception) becomes ONE RunDirError line: ``message(detail)``, where ``detail``
    is the exception's type and first line. finetune's own errors and interrupts pass unchanged."""
    try:
        yield
    except (FinetuneError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        raise RunDirError(message(f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)) from exc


class Aborted(KeyboardInterrupt):
    """A second Ctrl+C during training: the loop stops at once, without the checkpoint the first one asks for."""


class Interrupted(Exception):
    """Training stopped on a signal after saving a checkpoint; ``exit_code`` is 128 + signal."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# OSErrors that mean "this file or folder cannot be read or written here": the user can fix them (free space,
# permissions, another path), so they are one line with exit code 2 like any other user mistake.
_IO_ERRNOS = {errno.ENOSPC: "no space left on the device; free some space", errno.EDQUOT: "disk quota exceeded",
              errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
              errno.EROFS: "read-only file system", errno.ENOENT: "no such file or folder",
              errno.ENOTDIR: "a part of the path is not a folder", errno.EISDIR: "it is a folder",
              errno.ENAMETOOLONG: "the name is too long", errno.EEXIST: "it already exists",
              errno.ENOTEMPTY: "the folder is not empty", errno.ELOOP: "too many symbolic links",
              errno.EMFILE: "too many open files", errno.EIO: "input/output error"}


# How torch reports a collective that waited past the process group's timeout (gloo; NCCL's watchdog).
_COLLECTIVE_TIMEOUTS = ("Timed out waiting", "collective operation timeout", "Connection closed by peer")


# How libraries word an I/O error they re-raise as their own exception (safetensors, torch's file writers).
_IO_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
            "Read-only file system": errno.EROFS}


def _io_cause(exc: BaseException) -> OSError | None:
    """The I/O error the user can fix behind ``exc``: ``exc`` itself, an OSError it was raised from (a library
    wrapping a full disk), or one its message names; None otherwise."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _IO_ERRNOS:
            return current
        text = str(current)
        code = next((number for words, number in _IO_TEXT.items() if words in text), None)
        if code is not None:
            return OSError(code, os.strerror(code))
        current = current.__cause__ or current.__context__
    return None


COMMAND_ENV = "FINETUNE_COMMAND"  # the command the user ran, in every process finetune starts for it


def command() -> str:
    """``finetune <command>`` of this process (for a message about what was stopped), or, in a process that
    finetune started for a command (its launcher, a rank: :data:`COMMAND_ENV`), that command's."""
    if os.environ.get(COMMAND_ENV):
        return os.environ[COMMAND_ENV]
    words = [a for a in sys.argv[1:3] if not a.startswith("-")][:1]
    return " ".join(["finetune", *words])


def describe(exc: BaseException) -> tuple[int, list[str]]:
    """The exit code and the lines to print for an exception that ends a command."""
    if isinstance(exc, Interrupted):
        return exc.exit_code, [str(exc)]
    if isinstance(exc, BrokenPipeError):  # the reader of our output went away (`finetune ls x | head`): say nothing
        return 141, []
    if isinstance(exc, Aborted):
        return 130, ["aborted (second interrupt): no checkpoint written for the current step"]
    if isinstance(exc, KeyboardInterrupt):  # Ctrl+C where no training loop was there to stop at a step boundary
        return 130, [f"interrupted (Ctrl+C): `{command()}` stopped before it finished; nothing it was writing was "
                     "published (an output appears only complete; a run keeps its checkpoints: resume it)"]
    if isinstance(exc, FinetuneError):
        return exc.exit_code, [f"error: {line}" for line in str(exc).splitlines() or [type(exc).__name__]]
    io = _io_cause(exc)
    if io is not None:
        where = io.filename or "a file"
        return 2, [f"error: cannot use {where}: {_IO_ERRNOS[io.errno]}"]
    if isinstance(exc, MemoryError):
        return 1, ["error: out of memory; lower train.micro_batch_size or data.max_seq_len"]
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    if type(exc).__name__ == "DistBackendError" or any(mark in first for mark in _COLLECTIVE_TIMEOUTS):
        return 1, [f"error: the processes lost each other in a collective ({type(exc).__name__}: {first}): another "
                   "rank failed (its error is above, and in train.log) or was busy longer than "
                   "launch.timeout_minutes allows; raise launch.timeout_minutes if a rank legitimately works alone "
                   "that long"]
    return 1, [f"error: internal error: {type(exc).__name__}: {first} (FINETUNE_DEBUG=1 shows the traceback; "
               "please report it)"]


class _SurvivesClosedPipe:
    """stdout / stderr that outlive their reader: when the pipe is closed (`finetune run ... | head -1`), the
    stream's file descriptor is pointed at /dev/null and the command goes on (training keeps logging to
    train.log); a closed pipe never stops a command. Everything else is the wrapped stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _drop(self) -> None:
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no real descriptor: swap the stream
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
            return
        self._stream = open(os.devnull, "w")  # noqa: SIM115  (lives as long as the process)

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def keep_output_going() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`_SurvivesClosedPipe` (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _SurvivesClosedPipe):
            setattr(sys, name, _SurvivesClosedPipe(stream))


_CTRL_C: list[KeyboardInterrupt] = []  # every Ctrl+C raised in this process, the last one last


def ctrl_c(exc: KeyboardInterrupt | None = None) -> KeyboardInterrupt:
    """Record a Ctrl+C as it is raised and return it to raise: Typer turns a KeyboardInterrupt into a silent exit
    130, after which :func:`run_main` still says what was stopped."""
    exc = KeyboardInterrupt() if exc is None else exc
    _CTRL_C.append(exc)
    return exc


def is_ctrl_c(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl+C raised by finetune's own SIGINT handlers (:func:`ctrl_c`), not a
    KeyboardInterrupt that some code raised itself (a plugin's is its failure, not the user's stop)."""
    return any(exc is seen for seen in _CTRL_C)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    raise ctrl_c()


def run_main(fn: Callable[[], Any], *, say_stops: bool = True) -> None:
    """Run a command; every way it can fail ends here as one message per problem and its exit code. Output to a
    closed pipe never stops it (:func:`keep_output_going`), and a Ctrl+C always says what it stopped.
    ``say_stops=False``: a stop by a signal (:class:`Interrupted`, a Ctrl+C) exits with its code in silence (a rank
    of several, whose rank 0 says it for all)."""
    keep_output_going()
    _CTRL_C.clear()  # a Ctrl+C of an earlier command in this process (tests run many) is not this command's
    own_sigint = (threading.current_thread() is threading.main_thread()
                  and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if own_sigint:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        _run(fn, say_stops)
    finally:
        if own_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(fn: Callable[[], Any], say_stops: bool) -> None:
    try:
        fn()
    except SystemExit as exc:
        if exc.code == 130 and _CTRL_C and say_stops:  # a Ctrl+C that Typer ended silently
            for line in describe(_CTRL_C[-1])[1]:
                print(line, file=sys.stderr)
        raise
    except BaseException as exc:
        if os.environ.get("FINETUNE_DEBUG") and not isinstance(exc, Interrupted):
            raise
        code, lines = describe(exc)
        if not say_stops and (isinstance(exc, Interrupted) or is_ctrl_c(exc)):
            lines = []
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (the interpreter flushes stdout again at exit)
        for line in lines:
            print(line, file=sys.stderr)
        sys.exit(code)
