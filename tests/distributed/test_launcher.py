"""Ctrl+C on a run of 2 processes ends as a run of one process ends: the ranks stop after the same step with a
checkpoint, the user reads finetune's one stop line (not one per rank, and none of torch elastic's shutdown warnings
or its SignalException traceback), and the command exits 130. Nothing of the run outlives the command.

The signal goes to the whole process group of `finetune run`, as a terminal's Ctrl+C does (torch elastic starts each
rank in a session of its own, so the launcher is what the terminal reaches, and it passes the signal on).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.storage import checkpoints, rundir
from tests.integration.conftest import tiny_recipe
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
STOP = re.compile(r"stopped by signal after step (\d+); checkpoint (step-\d+) saved; continue with "
                  r"`finetune resume (.+)`")


def _processes_naming(text: str) -> list[str]:
    """The command lines of the live processes (but this one) that name ``text``: a rank names its run's recipe."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_on_two_processes_says_stop_once_exits_130_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    recipe = write_recipe_file(tmp_path / "recipe.yaml", tiny_recipe(
        train={"max_steps": 100_000}, data={"eval": None}), output_dir=str(run))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out_file, err_file = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "finetune", "run", str(recipe), "--accelerate-config", "ddp",
                                 "--num-processes", "2"], env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "step 1/" not in out_file.read_text():  # the ranks train
            assert proc.poll() is None, f"the run ended before the test: {err_file.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no training step within 240 s"
            time.sleep(0.2)
        before = len(err_file.read_text())
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl+C: the whole foreground group
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr, stdout = err_file.read_text(), out_file.read_text()
    print(f"exit {code}; stderr after the signal:\n{stderr[before:]}")
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    assert "stopped by signal" not in stdout
    said = stderr[before:].splitlines()
    assert len(said) == 1 and STOP.fullmatch(said[0]), said  # the one line since the signal: finetune's stop line
    assert not _group_alive(proc.pid), _processes_naming(str(run))
    assert _processes_naming(str(run)) == []  # nor any rank, in its own session

    # the run is what a stop of one process leaves: the checkpoint the line names, whole and resumable, the line
    # in train.log, no scratch, and a lock the next command can take
    step, name, where = STOP.fullmatch(said[0]).groups()  # type: ignore[union-attr]
    assert Path(where) == run and int(step) >= 1 and name == f"step-{int(step):06d}"
    assert said[0] in (run / rundir.TRAIN_LOG).read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [name]
    info = checkpoints.inspect(run / "checkpoints" / name)
    assert info.resumable, info.reason
    checkpoints.verify(info.path, rundir.run_id(run))
    lock, _ = rundir.open_existing(run, "resume")
    lock.release()
