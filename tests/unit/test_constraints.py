"""Reproducible installs: pyproject.toml keeps ranges capped below the next major version, and constraints.txt
pins the exact versions the suite runs with (what `make` installs with), consistent with those ranges."""

from __future__ import annotations

import os
import re
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.cli_helpers import load_script

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [line for lines in project["optional-dependencies"].values() for line in lines]
    return [Requirement(line) for line in (*project["dependencies"], *extras)]


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_dependency_has_an_upper_bound_below_its_next_major_version() -> None:
    for requirement in _requirements():
        caps = [spec for spec in requirement.specifier if spec.operator == "<"]
        assert caps, f"{requirement}: no upper bound"
        for cap in caps:  # `<N` with N a major version (`<1` for a 0.x package): not a finer or a looser cap
            assert re.fullmatch(r"\d+", cap.version), f"{requirement}: cap on a major version, e.g. <{cap.version}"
            floor = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
            assert not floor or floor[0].major < int(cap.version), requirement


def test_the_constraints_pin_exact_versions_that_the_ranges_allow_and_leave_torch_alone() -> None:
    pins = _pins()
    assert {"transformers", "accelerate", "peft", "datasets", "deepspeed"} <= set(pins)
    for name, version in pins.items():
        assert name == canonical(name) and re.fullmatch(r"[0-9][0-9A-Za-z.]*", version), (name, version)  # no +cpu
        assert not name.startswith(("nvidia-", "triton")) and name not in ("torch", "finetune"), name
    for requirement in _requirements():
        if requirement.name == "torch":  # installed first, by TORCH_SPEC (the CPU wheel, or a CUDA build)
            continue
        pin = pins.get(canonical(requirement.name))
        assert pin is not None, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pin, prereleases=True), f"{requirement.name}=={pin} vs {requirement}"


@pytest.mark.skipif(os.environ.get("FINETUNE_TEST_LATEST") == "1", reason="make test-latest: newer by design")
def test_the_constraints_are_the_versions_this_suite_runs_with() -> None:
    """constraints.txt is what scripts/freeze_constraints.py writes from this venv: finetune[dev]'s whole
    dependency closure, at the installed versions (else: `make constraints`, after checking the suite)."""
    freeze = load_script("freeze_constraints.py", "freeze_constraints")
    assert CONSTRAINTS.read_text() == freeze.render(freeze.closure("finetune", {"dev"}))
    assert _pins()["transformers"] == metadata.version("transformers")


def test_make_installs_with_the_constraints_and_test_latest_without() -> None:
    def commands(target: str) -> list[str]:
        done = subprocess.run(["make", "-n", "-B", target, "VENV=/nonexistent/v", "LATEST=/nonexistent/l"],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]

    for target in ("setup", "test", "quickstart"):
        installs = commands(target)
        assert len(installs) == 2 and all("-c constraints.txt" in line for line in installs), installs
    latest = commands("test-latest")
    assert len(latest) == 2 and not any("-c " in line for line in latest), latest
