"""finetune.artifacts.reload's command line: what the one writer runs in a fresh process to compute an export's
logits. The reload of real exports is proved end to end by every export (tests/integration/test_export.py); here,
its refusals: each is one line on stderr and an exit code, never a traceback, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.artifacts import reload


def test_a_precision_that_is_not_a_training_precision_is_refused(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        reload.main([str(tmp_path), "--inputs", str(tmp_path / "in.safetensors"), "--output",
                     str(tmp_path / "out.safetensors"), "--mixed-precision", "fp8"])
    assert stop.value.code == 2
    assert "--mixed-precision" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


def test_a_folder_that_is_no_export_is_one_line_and_writes_nothing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")  # what the reload sets; restored after the test
    folder = tmp_path / "not-an-export"
    folder.mkdir()
    with pytest.raises(SystemExit) as stop:
        reload.main([str(folder), "--inputs", str(tmp_path / "in.safetensors"), "--output",
                     str(tmp_path / "out.safetensors"), "--mixed-precision", "no"])
    err = capsys.readouterr().err
    assert stop.value.code not in (0, None)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(folder) in err
    assert not (tmp_path / "out.safetensors").exists()
