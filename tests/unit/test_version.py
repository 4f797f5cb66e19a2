"""`finetune --version`: finetune's version and the key libraries' versions from their metadata, with none of the
heavy libraries imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import finetune
from finetune import version

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "accelerate", "peft", "datasets", "deepspeed", "bitsandbytes")


def test_version_prints_finetune_and_the_key_libraries_without_importing_them() -> None:
    probe = textwrap.dedent(f"""
        import sys
        sys.argv = ["finetune", "--version"]
        from finetune.cli import main
        try:
            main()
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        print("imported:", sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "imported: []"
    shown = dict(line.split(" ", 1) for line in lines[:-1])
    assert lines[0] == f"finetune {finetune.__version__}"
    for name in ("torch", "transformers", "accelerate", "peft", "datasets"):
        assert shown[name] == metadata.version(name)
    for name in ("deepspeed", "bitsandbytes"):  # optional: shown when installed
        assert shown.get(name) == version.installed(name)
    assert shown["python"] == ".".join(map(str, sys.version_info[:3]))
    assert done.stderr == ""


def test_a_missing_library_is_said_and_a_missing_optional_one_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.version

    def without(name: str) -> str:
        if name in ("peft", "deepspeed"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(version.metadata, "version", without)
    lines = version.report()
    assert "peft not installed" in lines
    assert not any(line.startswith("deepspeed") for line in lines)
    assert lines[0] == f"finetune {finetune.__version__}" and lines[-1].startswith("python ")


def test_the_package_version_is_the_installed_one() -> None:
    """pyproject reads the version from finetune/__init__.py: one number, in the metadata and on the screen."""
    assert metadata.version("finetune") == finetune.__version__
