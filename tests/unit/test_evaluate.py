"""finetune.commands.evaluate's scratch folder: new and empty, removed with everything in it however the block ends,
and a full disk there is one line naming the folder. Evaluating runs, checkpoints and exports is
tests/integration/test_eval_portable.py and test_train.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from finetune.commands.evaluate import scratch_folder
from finetune.errors import RunDirError


def test_the_scratch_folder_is_gone_after_the_block_however_it_ends(tmp_path: Path) -> None:
    with scratch_folder("eval-", tmp_path) as folder:
        assert folder.parent == tmp_path and folder.name.startswith("eval-") and list(folder.iterdir()) == []
        (folder / "model.safetensors").write_bytes(b"x")
    assert not folder.exists()
    with pytest.raises(ValueError, match="boom"), scratch_folder("eval-", tmp_path) as folder:
        raise ValueError("boom")
    assert not folder.exists() and list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_naming_the_folder(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match=f"no room for the scratch export in {tmp_path}") as info, \
            scratch_folder("eval-", tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert "\n" not in str(info.value)
