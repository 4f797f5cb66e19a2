"""The wheels bundled for the GPU machine without network (scripts/device_bundle.py): exactly what finetune needs at
run time and the machine's image (scripts/device_image.txt) lacks, pinned as the suite ran, with torch and the
packages optional there left out. Offline: the list is computed from this venv's metadata; nothing is downloaded."""

from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.cli_helpers import load_script

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]
# What must not travel, whatever the script says: the image's CUDA torch stays, and these are optional there
NEVER = {"torch", "wandb", "deepspeed", "flash-attn", "bitsandbytes"}
THE_IMAGE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                    "platform_system": "Linux", "platform_machine": "x86_64"}
latest = pytest.mark.skipif(os.environ.get("FINETUNE_TEST_LATEST") == "1",
                            reason="make test-latest: the installed versions differ from constraints.txt by design")


@pytest.fixture(scope="module")
def bundle_script() -> ModuleType:
    return load_script("device_bundle.py", "device_bundle")


def _needs(name: str) -> set[str]:
    """What the installed ``name`` requires on the image's Python, without extras."""
    needs = set()
    for line in metadata.requires(name) or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({**THE_IMAGE_PYTHON, "extra": ""}):
            needs.add(canonicalize_name(requirement.name))
    return needs


def test_the_image_list_parses_and_says_where_it_comes_from(bundle_script: ModuleType) -> None:
    path = REPO / "scripts" / "device_image.txt"
    image = bundle_script.read_image(path)
    assert len(image) > 150 and all(name == canonicalize_name(name) for name in image)
    assert image["torch"] == Version("2.11.0") and image["transformers"] == Version("5.17.0")
    assert image["peft"] is None  # listed without a version
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any("2026-11-17" in line for line in header) and any("3.12" in line for line in header)


@latest
def test_the_bundle_is_what_finetune_needs_at_run_time_and_the_image_lacks(bundle_script: ModuleType) -> None:
    image = bundle_script.read_image()
    plan = bundle_script.plan(image, bundle_script.read_pins())
    bundle = set(plan.bundle)
    runtime = {canonicalize_name(Requirement(line).name)
               for line in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert runtime - set(image) - NEVER <= bundle  # datasets, pydantic
    assert {"datasets", "pydantic", "pydantic-core"} <= bundle
    for name in bundle:  # and what they need in turn, unless the image has it
        assert _needs(name) - set(image) - NEVER <= bundle, name
    assert not bundle & NEVER
    assert not bundle & set(image)  # the image's versions all fall in the ranges asked for
    # nothing that only an optional package needs: each bundled one is needed by finetune or by another bundled one
    for name in bundle:
        assert name in runtime or any(name in _needs(other) for other in bundle - {name}), name
    assert not bundle & {"cwevals", "opentelemetry-sdk", "hjson", "py-cpuinfo"}  # wandb's and deepspeed's alone
    assert {"wandb", "deepspeed", "torch"} <= plan.left_out


@latest
def test_every_bundled_package_is_pinned_as_in_the_constraints(bundle_script: ModuleType) -> None:
    pins = bundle_script.read_pins()
    plan = bundle_script.plan(bundle_script.read_image(), pins)
    assert plan.bundle and all(pins[name] == version for name, version in plan.bundle.items())


@latest
def test_an_image_version_outside_finetunes_range_travels_too(bundle_script: ModuleType) -> None:
    image = {**bundle_script.read_image(), "transformers": Version("4.57.0")}
    pins = bundle_script.read_pins()
    plan = bundle_script.plan(image, pins)
    assert plan.bundle["transformers"] == pins["transformers"]
    assert "the image has 4.57.0" in plan.why["transformers"]


@latest
def test_the_list_is_printed_without_downloading(bundle_script: ModuleType, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert bundle_script.main(["--list", "--dest", str(tmp_path / "wheels")]) == 0
    out = capsys.readouterr().out
    assert "pydantic==" in out and "left out: deepspeed, torch, wandb" in out
    assert not (tmp_path / "wheels").exists()


def test_a_rerun_keeps_the_right_wheels_and_removes_other_versions(bundle_script: ModuleType, tmp_path: Path) -> None:
    for name in ("pydantic-2.14.4-py3-none-any.whl",  # the pinned version: kept, not downloaded again
                 "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",  # likewise
                 "dill-0.3.9-py3-none-any.whl",  # an older pin: two versions would stop the install there
                 "multiprocess-0.70.19-py311-none-any.whl",  # the pinned version, for another Python
                 "other-1.0-py3-none-any.whl"):  # not the bundle's: left alone
        (tmp_path / name).touch()
    bundle = {"pydantic": "2.14.4", "pydantic-core": "2.50.5", "dill": "0.4.1", "multiprocess": "0.70.19"}
    folder = bundle_script.survey(tmp_path, bundle)
    assert sorted(folder.have) == ["pydantic", "pydantic-core"]
    assert sorted(path.name for path in folder.stale) == ["dill-0.3.9-py3-none-any.whl",
                                                           "multiprocess-0.70.19-py311-none-any.whl"]
    assert [path.name for path in folder.others] == ["other-1.0-py3-none-any.whl"]


def test_the_working_tree_and_the_wheels_must_fit_together(bundle_script: ModuleType) -> None:
    assert bundle_script.over_limit(30 * 2**20, 10 * 2**20) is None
    problem = bundle_script.over_limit(30 * 2**20, 11 * 2**20)
    assert problem is not None and "\n" not in problem and "41.0 MiB" in problem and "40 MiB" in problem


def test_make_device_bundle_runs_the_script_and_git_ignores_the_wheels() -> None:
    done = subprocess.run(["make", "--no-print-directory", "-n", "-B", "device-bundle", "VENV=/nonexistent/v"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # no directory lines under make
    assert done.returncode == 0, done.stderr
    assert "scripts/device_bundle.py" in done.stdout.splitlines()[-1], done.stdout
    assert "/.whl/" in (REPO / ".gitignore").read_text().splitlines()
