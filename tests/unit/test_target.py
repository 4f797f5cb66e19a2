"""finetune.artifacts.target without a model: which run a folder lies in, the refusal of a link inside a run, and the
overrides that let a run's recipe load on this machine for eval and merge."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.artifacts.target import check_own, owning_run, portable_overrides
from finetune.errors import RunDirError
from finetune.storage import rundir


def test_the_owning_run_is_the_nearest_folder_with_a_marker(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "x"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / rundir.MARKER).write_text("{}")
    assert owning_run(run / "checkpoints" / "step-000002") == run
    assert owning_run(run) == run
    assert owning_run(tmp_path / "runs") is None


def test_a_link_inside_a_run_is_refused_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    check_own(run, run / "checkpoints" / "step-000002")  # real folders all the way down: fine
    elsewhere = tmp_path / "other-final"
    elsewhere.mkdir()
    (run / "final").symlink_to(elsewhere)
    with pytest.raises(RunDirError, match="final: a symbolic link, not a folder of the run") as info:
        check_own(run, run / "final")
    assert "\n" not in str(info.value)


def test_eval_and_merge_run_one_process_whatever_the_run_was_launched_with() -> None:
    recipe = {"model": {"type": "tiny-llama"}, "launch": {"accelerate_config": "/elsewhere/fsdp.yaml",
                                                          "num_processes": 8}}
    assert portable_overrides(recipe) == (["launch.accelerate_config=cpu", "launch.num_processes=1"], [])
