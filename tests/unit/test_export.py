"""finetune.commands.export without training: where an export may be written (never into a run; an existing folder
replaced only when finetune wrote all of it). The exports themselves are tests/integration/test_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.commands.export import check_output
from finetune.errors import RunDirError
from finetune.storage import rundir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """An (empty) finetune run: its marker and recipe."""
    run = tmp_path / "runs" / "x"
    (run / rundir.CHECKPOINTS).mkdir(parents=True)
    (run / rundir.MARKER).write_text(json.dumps({"run_id": "abc"}))
    (run / rundir.RESOLVED).write_text("name: x\n")
    return run


def test_an_export_never_goes_into_a_run(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "runs" / "y"
    other.mkdir()
    (other / rundir.MARKER).write_text("{}")
    for out, needle in [(run_dir, "inside the run"), (run_dir / rundir.CHECKPOINTS / "exp", "inside the run"),
                        (run_dir / "final", "inside the run"), (tmp_path / "runs", "contains the run"),
                        (other / "exp", "inside the run"), (other, "inside the run")]:
        with pytest.raises(RunDirError, match=needle):
            check_output(out, run_dir, overwrite=True)
    check_output(tmp_path / "exports" / "x", run_dir, overwrite=False)  # a new folder: fine
    assert not (tmp_path / "exports").exists(), "checking writes nothing"


def test_an_existing_folder_is_replaced_only_when_finetune_wrote_all_of_it(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exp"
    out.mkdir()
    check_output(out, run_dir, overwrite=False)  # empty: fine
    (out / "notes.md").write_text("mine")
    with pytest.raises(RunDirError, match="pass --overwrite"):
        check_output(out, run_dir, overwrite=False)
    with pytest.raises(RunDirError, match="did not write"):
        check_output(out, run_dir, overwrite=True)
    (out / "notes.md").unlink()
    (out / "config.json").write_text("{}")
    rundir.write_manifest(out, {"kind": "export"})
    check_output(out, run_dir, overwrite=True)
    with pytest.raises(RunDirError, match="pass --overwrite"):
        check_output(out, run_dir, overwrite=False)
