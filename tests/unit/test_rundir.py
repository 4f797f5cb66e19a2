"""The run directory is finetune's alone: what counts as finetune's, what --overwrite may delete, where a run dir may
be, the per-run lock, and the content inventories that checkpoints and exports are verified against."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.errors import RunDirError
from finetune.storage import rundir

REPO = Path(__file__).resolve().parents[2]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` with its bytes (None for folders): what a refusal must leave untouched."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def make_checkpoint(folder: Path, files: dict[str, bytes]) -> None:
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    rundir.write_manifest(folder, {"kind": "checkpoint", "run_id": "r1", "step": 2, "samples_seen": 8})


def pure_run(root: Path) -> Path:
    """A run dir holding one of everything finetune writes."""
    run = root / "run"
    rundir.create(run, overwrite=False).release()
    for name in (rundir.RESOLVED, rundir.METRICS, rundir.TRAIN_LOG, rundir.WANDB_RUN_ID):
        (run / name).write_text("x\n")
    (run / rundir.WANDB / "run-1").mkdir(parents=True)
    (run / rundir.WANDB / "run-1" / "events").write_text("wandb's own files\n")
    (run / rundir.WANDB / "latest-run").symlink_to("run-1")
    rundir.record_tree(run / rundir.WANDB, set())  # as the tracker does at its close
    make_checkpoint(rundir.step_dir(run, 2), {"model.safetensors": b"weights", "train_state.json": b"{}",
                                              "rng_state_0.json": b"{}", "optim_0/__0_0.distcp": b"moments"})
    make_checkpoint(run / rundir.CHECKPOINTS / "step-000004.tmp", {"model.safetensors": b"w"})  # renamed next
    make_checkpoint(run / rundir.FINAL, {"config.json": b"{}", "model.safetensors": b"w"})
    return run


def crashed_write(run: Path, *user_files: str) -> Path:
    """``checkpoints/step-000006.tmp`` as a killed save leaves it (no manifest: files of the shapes a complete
    checkpoint of the run lists, ranks and shards of another world size too), plus ``user_files``."""
    folder = run / rundir.CHECKPOINTS / "step-000006.tmp"
    (folder / "optim_0").mkdir(parents=True, exist_ok=True)
    (folder / "optim_0" / "__3_0.distcp").write_bytes(b"half")
    (folder / "model.safetensors").write_bytes(b"half")
    (folder / "rng_state_3.json").write_bytes(b"{")
    (folder / ".tmpA1b2C3").write_bytes(b"half")  # safetensors' scratch, killed before its rename
    (folder / "optim_0" / ".tmpZ9y8X7").write_bytes(b"half")
    for name in user_files:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text("mine")
    return folder


def crashed_reshard(run: Path, *user_files: str) -> Path:
    """``reshard.tmp`` as a killed resume leaves it (half a DeepSpeed conversion), plus ``user_files``."""
    folder = rundir.reshard_scratch(run)
    (folder / "universal" / "zero" / "w").mkdir(parents=True, exist_ok=True)
    (folder / "universal" / "zero" / "w" / "fp32.pt").write_bytes(b"half")
    for name in user_files:
        (folder / name).write_text("mine")
    return folder


def test_a_pure_run_has_nothing_foreign(tmp_path: Path) -> None:
    run = pure_run(tmp_path)
    assert rundir.foreign_entries(run) == []
    crashed_write(run)
    crashed_reshard(run)
    assert rundir.foreign_entries(run) == []  # a crash's scratch holds only finetune's files: --overwrite clears it


def test_resume_removes_a_crashed_write_s_scratch_but_never_the_user_s_files(tmp_path: Path) -> None:
    """A crashed ``step-N.tmp`` or ``reshard.tmp`` holding a user's file: resume refuses in one line and deletes
    nothing; once the file is moved away it resumes, and the scratch goes (only what finetune wrote is ever
    deleted: removing a folder keeps whatever else is in it)."""
    run = pure_run(tmp_path)
    crashed_write(run, "mine.md")
    crashed_reshard(run, "notes.txt")
    (run / rundir.CHECKPOINTS / "step-000006.tmp" / "optim_0" / "mine.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(RunDirError, match=r"resume refused: the scratch of a write that never finished holds files "
                       r"finetune did not write \(checkpoints/step-000006.tmp/mine.md, checkpoints/step-000006.tmp/"
                       r"optim_0/mine.txt, reshard.tmp/notes.txt\)"):
        rundir.open_existing(run, "resume")
    assert tree(tmp_path) == before
    leftover = rundir.remove_checkpoint(run / rundir.CHECKPOINTS / "step-000006.tmp")
    assert leftover == ["checkpoints/step-000006.tmp/mine.md", "checkpoints/step-000006.tmp/optim_0/mine.txt"]
    assert sorted(p.name for p in (run / rundir.CHECKPOINTS / "step-000006.tmp").rglob("*")) == [
        "mine.md", "mine.txt", "optim_0"]
    assert rundir.remove_owned(rundir.reshard_scratch(run), "reshard.tmp") == ["reshard.tmp/notes.txt"]
    assert [p.name for p in rundir.reshard_scratch(run).iterdir()] == ["notes.txt"]
    for mine in ("step-000006.tmp/mine.md", "step-000006.tmp/optim_0/mine.txt"):
        (run / rundir.CHECKPOINTS / mine).unlink()
    (rundir.reshard_scratch(run) / "notes.txt").unlink()
    crashed_write(run)
    crashed_reshard(run)
    rundir.open_existing(run, "resume")[0].release()
    assert rundir.remove_checkpoint(run / rundir.CHECKPOINTS / "step-000006.tmp") == []
    assert rundir.remove_owned(rundir.reshard_scratch(run), "reshard.tmp") == []
    assert not (run / rundir.CHECKPOINTS / "step-000006.tmp").exists() and not rundir.reshard_scratch(run).exists()


def test_a_killed_safetensors_save_leaves_scratch_that_is_finetune_s(tmp_path: Path) -> None:
    """safetensors writes through a hidden ``.tmp`` + 6 letters in the folder it saves into and renames it; a SIGKILL
    mid-save leaves that file in ``step-N.tmp`` (CI saw resume refuse on it). It is finetune's (any folder of the
    write); a name of another shape, or one inside a folder finetune does not write, stays the user's."""
    run = pure_run(tmp_path)
    folder = crashed_write(run, ".tmp_mine", ".tmpTooLong1", "notes/.tmpA1b2C3")
    assert rundir.crashed_writes_foreign(run) == [f"checkpoints/step-000006.tmp/{rel}" for rel in (
        ".tmpTooLong1", ".tmp_mine", "notes", "notes/.tmpA1b2C3")]
    rundir.remove_checkpoint(folder)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == [
        ".tmpTooLong1", ".tmp_mine", "notes", "notes/.tmpA1b2C3"]


@pytest.mark.parametrize(("plant", "expected"), [
    (lambda run: (run / "notes.txt").write_text("mine"), "notes.txt"),
    (lambda run: (run / "src").mkdir(), "src"),
    (lambda run: (run / "data.jsonl").symlink_to("/etc/hostname"), "data.jsonl"),
    (lambda run: (run / rundir.CHECKPOINTS / "README").write_text("mine"), "checkpoints/README"),
    (lambda run: (rundir.step_dir(run, 2) / "extra.pt").write_text("mine"), "checkpoints/step-000002/extra.pt"),
    (lambda run: (run / rundir.FINAL / "my_notes.md").write_text("mine"), "final/my_notes.md"),
    (lambda run: (run / rundir.FINAL / rundir.MANIFEST).unlink(), "final/ (no readable manifest.json"),
    (lambda run: (run / rundir.CHECKPOINTS / "step-000009").symlink_to(Path.home()), "checkpoints/step-000009"),
    # inside the folders finetune or its trackers write: the same inventory rule
    (lambda run: (run / rundir.WANDB / "my-notes.md").write_text("mine"), "wandb/my-notes.md"),
    (lambda run: (run / rundir.WANDB / "run-1" / "mine.md").write_text("mine"), "wandb/run-1/mine.md"),
    (lambda run: (run / rundir.TENSORBOARD).mkdir(), "tensorboard/ (no readable manifest.json"),
    (lambda run: (run / rundir.CHECKPOINTS / "step-000004.tmp" / "mine.md").write_text("x"),
     "checkpoints/step-000004.tmp/mine.md"),
    # a write that never finished (no manifest yet): its inventory is what such a write writes
    (lambda run: crashed_write(run, "mine.md"), "checkpoints/step-000006.tmp/mine.md"),
    (lambda run: crashed_reshard(run, "mine.md"), "reshard.tmp/mine.md"),
    (lambda run: (run / rundir.FINAL_TMP).mkdir(), "final.tmp/ (no readable"),
    (lambda run: (run / rundir.FINAL_OLD).mkdir(), "final.old.tmp/ (no readable"),
])
def test_anything_finetune_did_not_write_is_foreign(tmp_path: Path, plant, expected: str) -> None:
    run = pure_run(tmp_path)
    plant(run)
    foreign = rundir.foreign_entries(run)
    assert len(foreign) == 1 and foreign[0].startswith(expected), foreign


def test_create_makes_a_marked_locked_run(tmp_path: Path) -> None:
    run = tmp_path / "a" / "b"
    with rundir.create(run, overwrite=False) as lock:
        assert json.loads((run / rundir.MARKER).read_text())["run_id"] == rundir.run_id(run)
        assert f"pid {os.getpid()}" in lock.path.read_text()
    (tmp_path / "empty").mkdir()
    rundir.create(tmp_path / "empty", overwrite=False).release()  # an empty folder may become a run


def test_overwrite_deletes_only_what_finetune_wrote(tmp_path: Path) -> None:
    run = pure_run(tmp_path)
    old_id = rundir.run_id(run)
    with pytest.raises(RunDirError, match="already holds a run; pass --overwrite"):
        rundir.create(run, overwrite=False)
    rundir.create(run, overwrite=True).release()
    assert sorted(p.name for p in run.iterdir()) == sorted([rundir.LOCK, rundir.MARKER])
    assert rundir.run_id(run) != old_id  # a new run


def test_overwrite_refuses_and_deletes_nothing_when_anything_is_foreign(tmp_path: Path) -> None:
    run = pure_run(tmp_path)
    (rundir.step_dir(run, 2) / "my_analysis.ipynb").write_text("hours of work")
    before = tree(tmp_path)
    with pytest.raises(RunDirError, match=r"--overwrite refused: .*my_analysis\.ipynb.*nothing was deleted"):
        rundir.create(run, overwrite=True)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_that_is_not_a_run_is_never_used(tmp_path: Path, overwrite: bool) -> None:
    project = tmp_path / "project"
    (project / "final").mkdir(parents=True)  # looks like an export, but it is the user's
    (project / "final" / "thesis.tex").write_text("mine")
    (project / "train.py").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(RunDirError, match="exists and is not a finetune run"):
        rundir.create(project, overwrite=overwrite)
    assert tree(tmp_path) == before


def test_protected_locations_are_refused(tmp_path: Path, monkeypatch) -> None:
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "train.jsonl").write_text("{}\n")
    (work / "file.txt").write_text("x")
    monkeypatch.chdir(work)
    cases = {
        Path("/"): "root folder",
        Path.home(): "home folder",
        Path("."): "it is the current folder",
        tmp_path: "the current folder is in it",
        work / "data": "train.jsonl is in it",
        REPO / "finetune": "it is the finetune package",
        work / "file.txt": "it is a file",
    }
    for run_dir, why in cases.items():
        with pytest.raises(RunDirError, match=why):
            rundir.check_location(run_dir, [work / "data" / "train.jsonl"])
    rundir.check_location(work / "runs" / "x", [work / "data" / "train.jsonl"])  # beside them is fine


HOLD = """
import sys, time
from pathlib import Path
from finetune.storage import rundir
lock = rundir.RunLock.acquire(Path(sys.argv[1]), "finetune run holder")
print("locked", flush=True)
time.sleep(120)
"""


def test_the_lock_refuses_a_second_process_with_the_pid_and_dies_with_its_holder(tmp_path: Path) -> None:
    run = pure_run(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        for attempt in (lambda: rundir.RunLock.acquire(run, "x"), lambda: rundir.create(run, overwrite=True),
                        lambda: rundir.create(run, overwrite=False), lambda: rundir.open_existing(run, "resume")):
            with pytest.raises(RunDirError, match=rf"in use by pid {holder.pid} \(`finetune run holder`"):
                attempt()
        assert rundir.foreign_entries(run) == [] and (run / rundir.FINAL).is_dir()  # nothing was touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the kernel released the flock with the process
        try:
            rundir.RunLock.acquire(run, "after").release()
            break
        except RunDirError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_inventory_problems_catch_same_size_changes_missing_and_extra_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000002"
    make_checkpoint(ckpt, {"model.safetensors": b"abcdef", "optimizer.bin": b"123"})
    manifest = rundir.read_manifest(ckpt)
    assert rundir.inventory_problems(ckpt, manifest, hashes=True) == []
    (ckpt / "model.safetensors").write_bytes(b"abcdeX")  # same size, other bytes
    assert rundir.inventory_problems(ckpt, manifest, hashes=False) == []
    assert rundir.inventory_problems(ckpt, manifest, hashes=True) == ["model.safetensors was modified (sha256 differs)"]
    (ckpt / "optimizer.bin").unlink()
    (ckpt / "custom_checkpoint_0.pkl").write_bytes(b"payload")
    assert rundir.inventory_problems(ckpt, manifest, hashes=False) == [
        "optimizer.bin is missing", "custom_checkpoint_0.pkl is not part of it"]


def test_publish_keeps_a_complete_export_at_every_moment(tmp_path: Path) -> None:
    out, tmp, old = tmp_path / "final", tmp_path / "final.tmp", tmp_path / "final.old.tmp"
    out.mkdir()
    (out / "v").write_text("1")
    tmp.mkdir()
    (tmp / "v").write_text("2")
    rundir.publish(tmp, out, old)
    assert (out / "v").read_text() == "2" and not tmp.exists() and not old.exists()


def test_run_id_of_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="not a finetune run directory"):
        rundir.run_id(tmp_path)
    (tmp_path / rundir.MARKER).write_text("{broken")
    with pytest.raises(RunDirError, match="corrupted"):
        rundir.run_id(tmp_path)


def test_a_tracker_folder_lists_only_what_appeared_while_it_ran(tmp_path: Path) -> None:
    """A note put in wandb/ before a resumed run stays the user's after that run records its folder."""
    run = pure_run(tmp_path)
    folder = run / rundir.WANDB
    (folder / "my-notes.md").write_text("mine")
    before = rundir.tree_names(folder)
    (folder / "run-2").mkdir()
    (folder / "run-2" / "events").write_text("the resumed run's\n")
    rundir.record_tree(folder, before)
    assert rundir.foreign_entries(run) == ["wandb/my-notes.md"]
