"""finetune as a user gets it from ``pip install``: a wheel built offline from this checkout, installed into a fresh
folder, used from an empty folder.

The recipes, presets, data and accelerate configs live in the checkout's top-level folders; these tests prove that
the wheel carries them and that finetune finds them there (finetune/config/resources.py), not in the checkout. The venv
also has this project installed in editable mode, so every check first asserts which ``finetune`` is imported.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from finetune.runtime.launch import LAUNCHER_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# what the build must not see or copy: the venv, VCS data, caches, runs and earlier build outputs (see .gitignore)
NOT_SOURCES = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", "runs",
                                     "wandb", "build", "dist", "*.egg-info")


@dataclass
class Installed:
    """A wheel installed with ``pip install --target``: where it is, and an empty folder to run commands in."""

    wheel: Path
    target: Path
    cwd: Path
    env: dict[str, str]
    build_log: str  # what the build backend printed (pip -v)

    def finetune(self, *args: str) -> subprocess.CompletedProcess:
        """The installed ``finetune`` console script, run in the empty folder against the installed package."""
        return subprocess.run([str(self.target / "bin" / "finetune"), *args], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=300)

    def python(self, code: str) -> str:
        """stdout of ``python -c code`` with the same environment and folder as :meth:`finetune`."""
        done = subprocess.run([sys.executable, "-c", code], cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout


def _pip(*args: str, verbose: bool = False) -> str:
    """Run pip offline (nothing is downloaded: --no-index, --no-deps, and the venv's setuptools builds); its output
    (the build backend's too with ``verbose``)."""
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "--disable-pip-version-check",
                           "-v" if verbose else "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Build the wheel from a copy of the checkout (a setuptools build writes build/ and *.egg-info next to the
    sources, and the checkout's finetune.egg-info belongs to its editable install), install it into a fresh
    --target folder, and set up an empty working folder with PYTHONPATH pointing at the installation."""
    root = tmp_path_factory.mktemp("wheel")
    source, wheels, target, cwd = root / "source", root / "wheels", root / "target", root / "empty"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES, symlinks=True)
    build_log = _pip("wheel", "--no-build-isolation", "-w", str(wheels), str(source), verbose=True)
    wheel = next(wheels.glob("finetune-*.whl"))
    _pip("install", "--no-compile", "--target", str(target), str(wheel))
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in (*LAUNCHER_ENV, "PYTHONPATH", "FINETUNE_RECIPES_DIR", "FINETUNE_DEBUG")}
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", COLUMNS="200")
    return Installed(wheel, target, cwd, env, build_log)


def _shipped_sources() -> dict[str, Path]:
    """Every file the wheel must carry, by its name inside the wheel: the finetune/ modules and assets, the recipes
    (presets, data) and the accelerate configs, as they are in the checkout."""
    folders = {"finetune": "finetune", "recipes": "finetune/_recipes",
               "accelerate_configs": "finetune/_accelerate_configs"}
    files: dict[str, Path] = {}
    for folder, inside in folders.items():
        for path in (REPO / folder).rglob("*"):
            relative = path.relative_to(REPO / folder)
            if path.is_file() and "__pycache__" not in relative.parts and path.suffix != ".pyc":
                files[f"{inside}/{relative.as_posix()}"] = path
    return files


def test_the_wheel_carries_every_module_recipe_and_accelerate_config(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        expected = _shipped_sources()
        missing = sorted(set(expected) - names)
        assert not missing, f"not in the wheel (add the package to [tool.setuptools] in pyproject.toml): {missing}"
        for name in ("finetune/_recipes/quickstart.yaml", "finetune/_accelerate_configs/zero2.yaml"):
            assert wheel.read(name) == expected[name].read_bytes()
    assert not any(name.startswith(("recipes/", "accelerate_configs/", "tests/")) for name in names)


def test_the_build_warns_about_nothing(installed: Installed) -> None:
    """setuptools warns (one block per folder, ~50 lines each) about every data folder that ships as package data
    of a parent package without being listed in [tool.setuptools] packages (recipes/data/shapes and its images
    were); the build prints no warning of setuptools at all."""
    warned = [line.strip() for line in installed.build_log.splitlines()
              if re.search(r"\w*Warning\b|absent from the `packages`", line)]
    assert not warned, "\n".join(warned)
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        info = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = wheel.read(info).decode()
    shapes = sorted((REPO / "recipes" / "data" / "shapes").rglob("*.*"))
    assert shapes and all(f"finetune/_recipes/data/{p.relative_to(REPO / 'recipes' / 'data').as_posix()}" in names
                          for p in shapes)
    # the version is finetune.__version__ (read by setuptools from the file), and every requirement has an upper bound
    from finetune import __version__

    assert re.search(rf"^Version: {re.escape(__version__)}$", metadata, re.M)
    requirements = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    assert requirements and all("<" in requirement.split(";")[0] for requirement in requirements), requirements


def test_the_installed_package_and_its_shipped_files_win_over_the_checkout(installed: Installed) -> None:
    # the venv's editable finder would fill in a module missing from the installation from the checkout: every
    # finetune module the CLI and the config package load must come from the installation
    out = installed.python("import sys, finetune.cli, finetune.config.resources as r\n"
                           "print(r.recipes_dir(), r.accelerate_configs_dir(), sep='\\n')\n"
                           "print(*(m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'finetune'), "
                           "sep='\\n')")
    recipes, configs, *modules = (Path(line) for line in out.splitlines())
    package = installed.target / "finetune"
    assert package / "__init__.py" in modules and package / "config" / "compose.py" in modules
    assert all(package in module.parents for module in modules), modules  # PYTHONPATH beats the editable install
    assert recipes == package / "_recipes" and configs == package / "_accelerate_configs"


def test_recipes_lists_the_shipped_recipes_from_an_empty_folder(installed: Installed) -> None:
    done = installed.finetune("recipes")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    shipped = {p.name for p in (REPO / "recipes").glob("*.yaml")}
    presets = {f"presets/{p.name}" for p in (REPO / "recipes" / "presets").glob("*.yaml")}
    assert "quickstart.yaml" in listed and listed == shipped | presets


def test_config_by_name_resolves_data_and_accelerate_configs_inside_the_installation(installed: Installed) -> None:
    done = installed.finetune("config", "quickstart")
    assert done.returncode == 0, done.stderr
    cfg = yaml.safe_load(done.stdout)
    data = installed.target / "finetune" / "_recipes" / "data"
    assert cfg["data"]["train"] == str(data / "reverse_train.jsonl")  # relative to the shipped recipe file
    assert cfg["output_dir"] == str(installed.cwd / "runs" / "quickstart")  # relative to the working folder

    zero2 = installed.finetune("config", "quickstart", "launch.accelerate_config=zero2")
    assert zero2.returncode == 0, zero2.stderr
    assert yaml.safe_load(zero2.stdout)["launch"]["accelerate_config"] == "zero2"

    plan = installed.finetune("run", "quickstart", "--accelerate-config", "zero2", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert f"effective settings ({installed.target / 'finetune' / '_accelerate_configs' / 'zero2.yaml'})" \
        in plan.stdout

    wrong = installed.finetune("config", "quickstart", "launch.accelerate_config=zero9")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert wrong.stderr.startswith("error: launch.accelerate_config: 'zero9'") and "'zero2'" in wrong.stderr


def test_a_user_recipe_extends_a_shipped_recipe_and_preset(installed: Installed, tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: [quickstart.yaml, presets/smoke.yaml]\nname: mine\n")
    done = installed.finetune("config", str(mine), "--provenance")
    assert done.returncode == 0, done.stderr
    smoke = installed.target / "finetune" / "_recipes" / "presets" / "smoke.yaml"
    max_steps = next(line for line in done.stdout.splitlines() if line.strip().startswith("max_steps:"))
    assert max_steps.split("#")[0].split(":")[1].strip() == "4" and str(smoke) in max_steps


def test_an_unknown_recipe_name_is_one_line_listing_the_shipped_names(installed: Installed) -> None:
    done = installed.finetune("run", "quickstrat")
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'quickstrat'" in lines[0] and "quickstart" in lines[0].split("shipped", 1)[1]


def test_shipped_recipe_data_is_protected_from_the_run_dir(installed: Installed) -> None:
    data = installed.target / "finetune" / "_recipes" / "data"
    done = installed.finetune("run", "quickstart", "-o", str(data), "--dry-run")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot be a run directory" in done.stderr and "reverse_train.jsonl is in it" in done.stderr


def test_run_quickstart_by_name_trains_into_the_working_folder(installed: Installed) -> None:
    done = installed.finetune("run", "quickstart", "train.max_steps=2", "train.micro_batch_size=8",
                              "train.global_batch_size=8", "data.eval=null", "eval.at_start=false",
                              "eval.every_steps=null", "eval.metrics=[]", "checkpoint.every_steps=2",
                              "checkpoint.keep_last=1", "logging.every_steps=1", "logging.progress=false")
    assert done.returncode == 0, done.stdout + done.stderr
    run = installed.cwd / "runs" / "quickstart"
    assert (run / "recipe.resolved.yaml").is_file() and (run / "final" / "model.safetensors").is_file()
    resolved = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    assert resolved["train"]["max_steps"] == 2
    assert resolved["data"]["train"].startswith(str(installed.target / "finetune" / "_recipes" / "data"))
    assert "step 2/2" in (run / "train.log").read_text()
    assert sorted(p.name for p in installed.cwd.iterdir()) == ["runs"]  # nothing else written to the working folder
