"""The tests mirror the package: every module of finetune/ has a tests/*/test_<module>.py, so its tests are found by
its name. Matched by file name only (storage/checkpoints.py and artifacts/checkpoint.py are test_checkpoints.py and
test_checkpoint.py); a module with no such file is in EXEMPT with the reason, or this test fails naming it."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "finetune"

# module (relative to finetune/) -> why it has no test_<module>.py yet
EXEMPT: dict[str, str] = {}


def modules() -> list[str]:
    """Every module of the package (relative to finetune/), but __init__.py and __main__.py."""
    return sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                  if path.name not in ("__init__.py", "__main__.py"))


def names_of_test_files() -> set[str]:
    """The names of the test files in tests/<kind>/."""
    return {path.name for path in TESTS.glob("*/test_*.py")}


def untested(names: set[str]) -> list[str]:
    """The modules that have neither a test file among ``names`` nor an exemption."""
    return [module for module in modules()
            if f"test_{Path(module).name}" not in names and module not in EXEMPT
            ]


def test_every_module_has_a_test_file_of_its_name() -> None:
    missing = untested(names_of_test_files())
    assert not missing, f"add tests/<unit|integration|distributed>/test_<module>.py for: {missing}"


def test_every_exemption_is_still_needed() -> None:
    """An exempt module that is gone, or that now has its test file, leaves EXEMPT."""
    names, present = names_of_test_files(), set(modules())
    stale = [module for module in EXEMPT if module not in present or f"test_{Path(module).name}" in names]
    assert not stale, f"remove from EXEMPT: {stale}"


def test_the_check_can_fail() -> None:
    """Without the test files, every module that is not exempt is named."""
    missing = untested(set())
    assert "storage/choose.py" in missing and "cli.py" in missing
    assert "runtime/loop.py" in missing and "data/vision.py" in missing
    assert not set(EXEMPT) & set(missing)
