"""Running the real ``finetune`` entry point in-process from tests, and what a user mistake must look like."""

from __future__ import annotations

import sys

import pytest

from finetune.cli import main


def main_exit(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
              ) -> tuple[int, str, str]:
    """:func:`finetune.cli.main` with ``args`` in this process: (exit code, stdout, stderr) of this call only."""
    monkeypatch.setattr(sys, "argv", ["finetune", *args])
    capsys.readouterr()  # drop what earlier calls printed
    with pytest.raises(SystemExit) as info:
        main()
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def assert_user_error(code: int, out: str, err: str, *needles: str) -> list[str]:
    """Exit code 2, nothing on stdout, only ``error: ...`` lines on stderr, no traceback; return those lines."""
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "internal error" not in err, err
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), err
    for needle in needles:
        assert needle in err, (needle, err)
    return lines
