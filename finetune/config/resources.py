"""The one place that finds the files finetune ships: the recipes (with their presets and data) and the accelerate
configs.

They live in the repository's top-level ``recipes/`` and ``accelerate_configs/`` folders, where users read and copy
them, and pyproject.toml packages those folders as the subpackages ``finetune._recipes`` and
``finetune._accelerate_configs`` (a setuptools package-dir mapping). So a path relative to a source file is wrong
outside a checkout: a wheel installs the folders inside the ``finetune`` package, while an editable install maps
the subpackage names back to the checkout's folders. :mod:`importlib.resources` asks the import system, which knows
both layouts, so every caller (``extends:`` in compose, accelerate configs in validate and launch, the ``recipes``
command, recipes given by name on the command line) goes through this module instead of guessing paths.

Only leaf imports here (finetune.errors): the config package and the CLI both use it.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from finetune.errors import ConfigError

RECIPES_PACKAGE = "finetune._recipes"  # pyproject.toml maps it to recipes/
ACCELERATE_CONFIGS_PACKAGE = "finetune._accelerate_configs"  # pyproject.toml maps it to accelerate_configs/
RECIPES_ENV = "FINETUNE_RECIPES_DIR"  # a folder that replaces the shipped recipes (tests, site-wide presets)
RECIPE_SUFFIXES = (".yaml", ".yml")


# the checkout folder of each shipped data package, for finetune imported straight from a source checkout
_CHECKOUT_FOLDERS = {RECIPES_PACKAGE: "recipes", ACCELERATE_CONFIGS_PACKAGE: "accelerate_configs"}


def _checkout_folder(package: str) -> Path | None:
    """The folder of ``package`` when finetune is imported straight from a source checkout that pip has not
    installed (PYTHONPATH=<checkout>), or has installed in editable mode before these folders became packages:
    the import system then knows ``finetune`` but not ``finetune._recipes``. The checkout is recognised by its
    pyproject.toml and the folder's ``__init__.py``, so an unrelated top-level ``recipes`` package in
    site-packages is never taken for it."""
    package_dir = importlib.resources.files("finetune")
    if not isinstance(package_dir, Path):
        return None
    root = package_dir.parent
    folder = root / _CHECKOUT_FOLDERS[package]
    return folder if (root / "pyproject.toml").is_file() and (folder / "__init__.py").is_file() else None


def _package_folder(package: str) -> Path:
    """The folder of a shipped data package as a real file-system path.

    A Path, not just a Traversable: recipes name their data files and presets by paths relative to the recipe
    file, and accelerate gets its config by path. pip always installs finetune as files, so anything else is a
    broken installation, reported as one line rather than a traceback.
    """
    try:
        folder = importlib.resources.files(package)
    except ModuleNotFoundError:
        checkout = _checkout_folder(package)
        if checkout is not None:
            return checkout
        raise ConfigError(f"{package}: the shipped files are missing from this finetune installation; reinstall "
                          "it (pip install finetune, or pip install -e . in a checkout)") from None
    if not isinstance(folder, Path):
        raise ConfigError(f"{package}: finetune is installed as an archive ({folder!r}); install it as files "
                          "with pip")
    return folder


def recipes_dir() -> Path:
    """The shipped recipes folder (``FINETUNE_RECIPES_DIR`` replaces it): recipes, presets/ and data/."""
    env = os.environ.get(RECIPES_ENV)
    return Path(env) if env else _package_folder(RECIPES_PACKAGE)


def accelerate_configs_dir() -> Path:
    """The shipped accelerate configs folder (cpu.yaml, ddp.yaml, zero2.yaml, ...)."""
    return _package_folder(ACCELERATE_CONFIGS_PACKAGE)


def recipe_names() -> list[str]:
    """The names of the shipped recipes (``quickstart``, ...), sorted; presets are bases, not recipes to run."""
    folder = recipes_dir()
    return sorted(path.stem for path in folder.glob("*.yaml") if path.is_file()) if folder.is_dir() else []


def accelerate_config_names() -> list[str]:
    """The names of the shipped accelerate configs (``cpu``, ``ddp``, ``zero2``, ...), sorted."""
    return sorted(path.stem for path in accelerate_configs_dir().glob("*.yaml") if path.is_file())


def shipped_accelerate_config(name: str) -> Path | None:
    """The shipped accelerate config called ``name`` (``zero2`` -> .../zero2.yaml), or None."""
    if not name or Path(name).name != name:  # a plain name only: "../x" must not reach outside the folder
        return None
    path = accelerate_configs_dir() / f"{name}.yaml"
    return path if path.is_file() else None


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False for a name the OS refuses (too long) instead of an OSError."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def resolve_recipe(recipe: str | Path) -> Path:
    """The recipe file a command line names, so ``finetune run quickstart`` works from any folder.

    An existing file always wins, whatever its name. Otherwise a bare name (no folder, no .yaml) is a shipped
    recipe: ``quickstart`` -> the shipped quickstart.yaml, or one ConfigError line listing the shipped names. Any
    other path is returned unchanged, for compose to report as a missing recipe file.
    """
    path = Path(recipe)
    if _is_file(path):
        return path
    text = str(recipe)
    if not is_recipe_name(text):
        return path
    shipped = shipped_recipe(text)
    if shipped is not None:
        return shipped
    raise ConfigError(f"recipe {text!r}: no such file, and no shipped recipe of that name (shipped: "
                      f"{', '.join(recipe_names()) or 'none'}); pass a recipe .yaml path or a name from "
                      "`finetune recipes`")


def is_recipe_name(text: str) -> bool:
    """True when ``text`` can only mean a shipped recipe by name: no folder, no .yaml/.yml suffix, not . or .."""
    return bool(text) and os.sep not in text and "/" not in text and text not in (".", "..") \
        and Path(text).suffix.lower() not in RECIPE_SUFFIXES


def shipped_recipe(name: str) -> Path | None:
    """The shipped recipe called ``name`` (``quickstart`` -> .../quickstart.yaml), or None. The one lookup by name,
    for the command line (:func:`resolve_recipe`) and ``extends:`` (finetune.config.compose) alike."""
    return recipes_dir() / f"{name}.yaml" if is_recipe_name(name) and name in recipe_names() else None
