"""finetune.storage.choose: the one place that picks a checkpoint (resume, export, eval, ls) and says which newer
ones it passed over and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.errors import RunDirError
from finetune.storage import rundir
from finetune.storage.choose import choose, inventory, skipped_lines


def _checkpoint(run: Path, step: int, manifest: bool = True) -> Path:
    folder = rundir.step_dir(run, step)
    folder.mkdir(parents=True)
    (folder / rundir.TRAIN_STATE).write_text("{}")
    if manifest:
        rundir.write_manifest(folder, {"step": step, "samples_seen": 8 * step, "resumable": True, "reason": None})
    return folder


def test_the_newest_complete_checkpoint_is_chosen_and_newer_broken_ones_are_named(tmp_path: Path) -> None:
    for step in (100, 200):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 300, manifest=False)
    chosen = choose(tmp_path, None)
    assert chosen.path.name == "step-000200" and chosen.info.manifest["step"] == 200  # the manifest, read once
    assert [name for name, _ in chosen.skipped] == ["step-000300"]
    assert skipped_lines(chosen) == [f"skipped step-000300: {chosen.skipped[0][1]}; using step-000200"]
    assert "manifest" in chosen.skipped[0][1]
    assert [info.step for info in inventory(tmp_path)] == [100, 200, None]


def test_from_names_one_and_skips_nothing(tmp_path: Path) -> None:
    for step in (100, 200):
        _checkpoint(tmp_path, step)
    chosen = choose(tmp_path, "step-000100")
    assert chosen.path.name == "step-000100" and chosen.skipped == []
    with pytest.raises(RunDirError, match=r"--from step-000999: no such complete checkpoint .*have: step-000100, "):
        choose(tmp_path, "step-000999")


@pytest.mark.parametrize(("purpose", "needle"), [("resume", "no complete resumable checkpoint to resume from"),
                                                  ("export", "no complete checkpoint to export")])
def test_none_to_choose_is_one_line_that_lists_why(tmp_path: Path, purpose: str, needle: str) -> None:
    _checkpoint(tmp_path, 100, manifest=False)
    with pytest.raises(RunDirError) as info:
        choose(tmp_path, None, purpose)
    assert needle in str(info.value) and "step-000100: " in str(info.value) and "\n" not in str(info.value)
