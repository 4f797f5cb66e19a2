"""The lock one process fills the data caches under (finetune.runtime.cachelock): held by that process alone, so a
child it forked never keeps it; a process that waits says within seconds whom it waits for; neither the lock nor
its marker is written through a link."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from finetune.runtime import cachelock

REPO = Path(__file__).resolve().parents[2]
# takes the lock, forks a child that outlives it (as a tokenizing worker of a killed parent did), prints the
# child's pid, then waits to be killed
HOLDER = """
import os, sys, time
from pathlib import Path
from finetune.runtime import cachelock
with cachelock.held(Path(sys.argv[1]), "data.jsonl"):
    child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    time.sleep(120)
"""


def test_a_wait_says_whom_it_waits_for_and_ends_when_the_holder_dies(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder is SIGKILLed while the child it forked lives on: the lock is free at once (a flock stayed with
    the child). While waiting, one line names the data, the holder's pid and since when, and the lock file."""
    lock = tmp_path / "locks" / "key.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout is not None
    child = int(holder.stdout.readline())
    monkeypatch.setattr(cachelock, "SAY_AFTER_S", 0.3)
    monkeypatch.setattr(cachelock, "POLL_S", 0.05)
    killer = threading.Timer(1.5, holder.kill)
    killer.start()
    try:
        with cachelock.held(lock, "data.jsonl"):
            assert holder.poll() is not None or holder.wait(timeout=10) == -signal.SIGKILL
            assert os.path.exists(f"/proc/{child}") or sys.platform != "linux"  # the child still runs
    finally:
        killer.cancel()
        holder.kill()
        holder.wait()
        os.kill(child, signal.SIGKILL)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"waiting for the tokenization of data.jsonl by pid {holder.pid} (running since ")
    assert lines[0].endswith(f"); it holds {lock}")


def _symlink(place: Path, target: Path) -> None:
    place.symlink_to(target)


def _hard_link(place: Path, target: Path) -> None:
    os.link(target, place)


def _fifo(place: Path, target: Path) -> None:
    os.mkfifo(place)


@pytest.mark.parametrize("plant", [_symlink, _hard_link, _fifo], ids=["symlink", "hard-link", "fifo"])
def test_the_lock_and_its_marker_are_never_written_through_a_link(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  plant: Callable[[Path, Path], None]) -> None:
    """Whatever stands at the lock's or the marker's name is replaced by a fresh file of finetune's own (one note
    line each); the user's file it pointed to is unchanged, and a link there never counts as the marker."""
    mine = tmp_path / "mine.txt"
    mine.write_text("my notes\n")
    folder = tmp_path / "locks"
    folder.mkdir()
    lock, done = folder / "key.lock", folder / "key.done"
    for place in (lock, done):
        plant(place, mine)
    assert not cachelock.is_done(done)
    with cachelock.held(lock, "data.jsonl"):
        cachelock.mark_done(done)
    assert mine.read_text() == "my notes\n" and mine.stat().st_nlink == 1
    for place in (lock, done):
        info = os.lstat(place)
        assert place.is_file() and not place.is_symlink() and info.st_nlink == 1
    assert cachelock.is_done(done)
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 2 and all("not finetune's own file; replaced it" in note for note in notes), notes
