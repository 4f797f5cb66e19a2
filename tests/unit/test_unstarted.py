"""finetune.storage.unstarted: a run that fails before its first optimizer step leaves no folder behind, and a run
that did any work (a checkpoint, an export, a train row), or a folder holding anything finetune did not write, stays
exactly as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.storage import rundir
from finetune.storage.unstarted import discard, first_missing, trained_nothing


def _run(root: Path) -> Path:
    """A run folder as ``finetune run`` starts it: its marker, recipe and lock, two new folders deep."""
    run = root / "runs" / "x"
    run.mkdir(parents=True)
    (run / rundir.MARKER).write_text(json.dumps({"run_id": "abc"}))
    (run / rundir.RESOLVED).write_text("name: x\n")
    (run / rundir.LOCK).write_text("1")
    return run


def test_first_missing_is_the_outermost_folder_mkdir_p_makes(tmp_path: Path) -> None:
    assert first_missing(tmp_path / "a" / "b" / "c") == tmp_path / "a"
    assert first_missing(tmp_path) is None


@pytest.mark.parametrize("metrics,nothing", [
    (None, True),
    ('{"kind": "info", "message": "loading"}\n', True),
    ('{"kind": "train", "step": 1}\n', False),
    ('[1]\n{"kind": "info"}\n', False),  # a damaged file counts as work
], ids=["no-metrics", "no-train-row", "a-train-row", "damaged"])
def test_trained_nothing_reads_the_metrics(tmp_path: Path, metrics: str | None, nothing: bool) -> None:
    run = _run(tmp_path)
    if metrics is not None:
        (run / rundir.METRICS).write_text(metrics)
    assert trained_nothing(run) is nothing


@pytest.mark.parametrize("work", [rundir.CHECKPOINTS, rundir.FINAL, rundir.FINAL_TMP])
def test_a_checkpoint_or_an_export_is_work(tmp_path: Path, work: str) -> None:
    run = _run(tmp_path)
    (run / work).mkdir()
    assert not trained_nothing(run)
    assert not discard(run, tmp_path / "runs") and run.is_dir()


def test_discard_removes_what_this_invocation_made_and_nothing_more(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert discard(run, tmp_path / "runs")
    assert not (tmp_path / "runs").exists() and tmp_path.is_dir()
    run = _run(tmp_path)
    assert discard(run, None)  # the folder existed before the run: it stays, empty, as the user had it
    assert run.is_dir() and list(run.iterdir()) == []


def test_a_folder_holding_anything_else_stays_whole(tmp_path: Path) -> None:
    run = _run(tmp_path)
    (run / "notes.md").write_text("mine")
    assert not discard(run, tmp_path / "runs")
    assert sorted(p.name for p in run.iterdir()) == sorted([rundir.MARKER, rundir.RESOLVED, rundir.LOCK, "notes.md"])
    assert not discard(tmp_path / "nothing-here", None)
