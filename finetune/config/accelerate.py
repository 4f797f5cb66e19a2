"""The one reader of accelerate config files: find one by path or shipped name, read it, and say in one line what is
wrong with it.

Every command that needs an accelerate config reads it here, through :func:`finetune.backends.accelerate_config`
(which turns the settings into the Backend they select), except recipe validation, which sits below ``backends`` in
the layering and so calls :func:`load` itself. A missing, unreadable or invalid file is therefore the same
:class:`ConfigError` line (naming the file and the fix, exit 2) through ``finetune run``, ``plan``, ``generate`` and
validation; only its first words differ, naming the setting as that command spells it (``launch.accelerate_config``
or ``--accelerate-config``). """

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from finetune.config import resources
from finetune.errors import ConfigError

RECIPE_KEY = "launch.accelerate_config"  # the setting's name in a recipe (and what --accelerate-config sets there)
SHIPPED = "cpu, ddp, zero2, fsdp2, ..."


@dataclass(frozen=True)
class AccelerateFile:
    """An accelerate config as read: the file and its settings (``{}`` for an empty file)."""

    path: Path
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def distributed_type(self) -> str:
        """The file's :func:`distributed_type`."""
        return distributed_type(self.settings)


def distributed_type(settings: Mapping[str, Any]) -> str:
    """NO, MULTI_GPU, FSDP, DEEPSPEED, ... (upper case; accelerate's default NO when the settings do not say)."""
    return str(settings.get("distributed_type", "NO")).upper()


def locate(name: str) -> Path | None:
    """An accelerate config by path (an existing file wins) or by the name of a shipped one (``zero2``, found by
    :mod:`finetune.config.resources` in a checkout or an installed wheel alike); None if neither exists."""
    try:
        local = Path(name).is_file()
    except (OSError, ValueError):  # a name the OS refuses (too long): not a file
        local = False
    found = Path(name) if local else resources.shipped_accelerate_config(name)
    return found.resolve() if found is not None else None


def load(name: str, key: str = RECIPE_KEY) -> AccelerateFile:
    """The accelerate config ``name`` (a path or a shipped name), read; one ConfigError line, starting with ``key``
    (the setting as the command spells it), when there is no such file or :func:`read` refuses it."""
    path = locate(name)
    if path is None:
        raise ConfigError(f"{key}: {name!r} is neither a file nor a shipped accelerate config; use a path or one of "
                          f"{resources.accelerate_config_names()}")
    return AccelerateFile(path, read(path, key))


_READ: dict[tuple[Path, int, int], dict[str, Any]] = {}  # (file, mtime_ns, size) -> settings: read once a process


def read(path: Path, key: str = RECIPE_KEY) -> dict[str, Any]:
    """The settings of the accelerate config file ``path``; one ConfigError line (naming ``key``, the file, the cause
    and the fix) when it cannot be read, is not UTF-8 text (a binary file), is not YAML, or is not a mapping.
    A process reads a file once (validation, the one-machine check and the launch line all ask): later calls get a
    copy of the first read while the file's modification time and size are unchanged."""
    try:
        stat = path.stat()
        seen: tuple[Path, int, int] | None = (path, stat.st_mtime_ns, stat.st_size)
    except OSError:
        seen = None  # read_text below says why, in one line
    if seen in _READ:
        return copy.deepcopy(_READ[seen])
    settings = _parse(path, key)
    if seen is not None:
        _READ[seen] = copy.deepcopy(settings)
    return settings


def _parse(path: Path, key: str) -> dict[str, Any]:
    """:func:`read` without the memo."""
    fix = f"fix the file, or use a shipped config ({SHIPPED})"
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text) if "\x00" not in text else None
    except UnicodeDecodeError:
        text, data = "\x00", None
    except OSError as exc:
        raise ConfigError(f"{key}: {path} cannot be read ({exc.strerror or type(exc).__name__}); {fix}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: {path} is not valid YAML ({str(exc).splitlines()[0]}); {fix}") from None
    if "\x00" in text:
        raise ConfigError(f"{key}: {path} is a binary file, not an accelerate config (YAML text); give the path of "
                          f"one, or a shipped name ({SHIPPED})")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} holds a YAML {type(data).__name__}, not the mapping of settings an "
                          f"accelerate config is (distributed_type: ..., num_processes: ...); {fix}")
    return data
