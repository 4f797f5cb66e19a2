"""What the 2-process test files share across pytest-xdist workers: a run is trained once per session, whichever
worker asks first.

Why: ``make test`` runs these files with ``-n 2 --dist loadfile``, so tests/distributed/test_elastic.py (which reuses
the straight runs of test_backends.py) runs on the other worker, where an in-process cache is empty: it trained the
six backends' straight runs, the ZeRO-3 LoRA run and the 1-process references again (about 200 s of CPU on the
2-core CI machine, a launch being ~25 s of CPU, mostly imports). Here a run is made under a lock in a folder every
worker of the session sees; a worker that needs it while the other makes it waits, then reads the same files. A
run that failed leaves no mark, so the next test that needs it trains it again (and reports its own failure).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def session_folder(factory: pytest.TempPathFactory, name: str) -> Path:
    """``name`` in the folder every xdist worker of this session sees (the parent of each worker's basetemp), or
    in this session's basetemp without xdist. Created once; the same path in every worker."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / name
    folder.mkdir(exist_ok=True)
    return folder


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock`` (created if missing), held for the block: one process at a time."""
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def made_once(path: Path, make: Callable[[], object]) -> Path:
    """``path``, made by ``make()`` unless a process of this session already made it: under a lock beside it, and
    marked done (``<path>.made``, beside it: a run dir holds only finetune's files) only when ``make`` returned."""
    done = path.with_name(f"{path.name}.made")
    with _locked(path.with_name(f"{path.name}.lock")):
        if not done.exists():
            make()
            done.touch()
    return path
