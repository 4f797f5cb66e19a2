"""Running the real ``finetune`` entry point in-process from tests, and what a user mistake must look like."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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


def load_script(name: str, module_name: str) -> ModuleType:
    """``scripts/<name>`` imported as module ``module_name`` (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / name
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module
