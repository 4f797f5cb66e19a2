"""finetune.commands.merge's choice of where a merged model may be written: never over or inside its sources, and over
an existing folder only with --overwrite. The merge itself and its check are tests/integration/test_lora.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.commands.merge import check_output
from finetune.errors import RunDirError


def test_the_output_never_overlaps_a_source(tmp_path: Path) -> None:
    source = tmp_path / "adapter"
    source.mkdir()
    for out in (source, source / "merged", tmp_path):
        with pytest.raises(RunDirError, match="overlaps the source"):
            check_output(out, [source], overwrite=True)
    check_output(tmp_path / "merged", [source], overwrite=False)  # a new folder beside it: fine
    assert not (tmp_path / "merged").exists(), "checking writes nothing"


def test_a_folder_with_something_in_it_needs_overwrite(tmp_path: Path) -> None:
    source, out = tmp_path / "adapter", tmp_path / "merged"
    source.mkdir()
    out.mkdir()
    check_output(out, [source], overwrite=False)  # empty: fine
    (out / "notes.md").write_text("mine")
    with pytest.raises(RunDirError, match="pass --overwrite"):
        check_output(out, [source], overwrite=False)
