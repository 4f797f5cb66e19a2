"""Recipe composition: YAML files, ``extends:``, presets and dotted overrides -> one plain dict.

Pure functions, no torch. Every leaf key remembers which file (and line) or override set it, so
``finetune config --provenance`` can answer "where does this value come from?". Relative file paths in
``data.train`` / ``data.eval`` / ``model.path`` are resolved against the directory of the file that set them
(overrides: against the working directory), so a recipe works from any working directory.
"""

from __future__ import annotations

import copy
import os
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from finetune.config.schema import RecipeConfig
from finetune.errors import ConfigError

PATH_KEYS = ("data.train", "data.eval", "model.path")
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def recipes_dir() -> Path:
    """The shipped recipes/ folder (``FINETUNE_RECIPES_DIR`` overrides it)."""
    env = os.environ.get("FINETUNE_RECIPES_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "recipes"


@dataclass
class Composed:
    """A composed recipe: the merged dict and, per dotted leaf key, where its value came from."""

    data: dict[str, Any]
    provenance: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


class _Loader(yaml.SafeLoader):
    """A SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 insists on a dot: ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


class _LineLoader(_Loader):
    """A SafeLoader that records the line of every mapping key, for provenance."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict[str, Any]:
    mapping = loader.construct_mapping(node, deep=True)
    lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value}
    mapping["__lines__"] = lines  # removed again by _strip_lines
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Load one YAML mapping; return it and the line of each dotted key."""
    if not path.is_file():
        raise ConfigError(f"{path}: recipe file not found")
    try:
        raw = yaml.load(path.read_text(), Loader=_LineLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML ({problem})") from None
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping of keys, got {type(raw).__name__}")
    lines: dict[str, int] = {}
    return _strip_lines(raw, "", lines), lines


def _strip_lines(node: Any, prefix: str, lines: dict[str, int]) -> Any:
    if isinstance(node, dict):
        own = node.pop("__lines__", {})
        for key, line in own.items():
            lines[prefix + key] = line
        return {k: _strip_lines(v, f"{prefix}{k}.", lines) for k, v in node.items()}
    if isinstance(node, list):
        return [_strip_lines(v, prefix, {}) for v in node]
    return node


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaf values by dotted key (an empty mapping is a leaf), e.g. ``{"train.max_steps": 50}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``top`` over ``base``: mappings merge key by key, everything else (lists too) replaces."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _resolve_extends(entry: Any, owner: Path) -> Path:
    if not isinstance(entry, str):
        raise ConfigError(f"{owner}: extends: entries must be paths, got {entry!r}")
    for base in (owner.parent, recipes_dir()):
        candidate = (base / entry).resolve()
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{owner}: extends: {entry!r} not found relative to {owner.parent} or {recipes_dir()}")


def _resolve_paths(data: dict[str, Any], base: Path, keys: tuple[str, ...] = PATH_KEYS) -> None:
    """Make relative file paths in ``keys`` absolute against ``base`` where such a file or folder exists."""
    for dotted in keys:
        section, key = dotted.split(".")
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        if not isinstance(value, str) or "://" in value or Path(value).is_absolute():
            continue
        candidate = (base / value).resolve()
        if candidate.exists() or value.endswith(DATA_SUFFIXES) or value.startswith("."):
            data[section][key] = str(candidate)


def _compose_file(path: Path, chain: tuple[Path, ...]) -> Composed:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"extends: cycle {cycle}")
    raw, lines = _load_yaml(path)
    extends = raw.pop("extends", [])
    extends = [extends] if isinstance(extends, str) else extends
    if not isinstance(extends, list):
        raise ConfigError(f"{path}: extends: must be a path or a list of paths")
    merged = Composed(data={})
    for entry in extends:
        parent = _compose_file(_resolve_extends(entry, path), (*chain, path))
        merged.data = _merge(merged.data, parent.data)
        merged.provenance.update(parent.provenance)
        merged.files.extend(parent.files)
    _resolve_paths(raw, path.parent)
    merged.data = _merge(merged.data, raw)
    for leaf in flatten(raw):
        merged.provenance[leaf] = f"{_display(path)}:{lines.get(leaf, '?')}"
    merged.files.append(path)
    return merged


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _field_is_text(dotted: str) -> bool:
    """True when the schema types ``dotted`` as a string, so an override value stays verbatim."""
    model: type[BaseModel] | None = RecipeConfig
    annotation: Any = None
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        nested = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = nested[0] if nested else None
    # str, str | None, or a Literal of strings ("no" must not become False); not list[str] or dict[str, ...]
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return any(a is str or (get_origin(a) is Literal and all(isinstance(v, str) for v in get_args(a)))
               for a in options)


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``a.b=c``; the value is YAML-parsed unless the schema types the key as a string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: expected key.path=value, e.g. train.max_steps=50")
    if _field_is_text(key) and raw not in ("null", "~", ""):
        return key, raw
    try:
        return key, yaml.load(raw, Loader=_Loader) if raw else None  # a SafeLoader subclass
    except yaml.YAMLError:
        raise ConfigError(f"override {item!r}: value is not valid YAML") from None


def apply_overrides(composed: Composed, overrides: list[str]) -> Composed:
    """Set dotted ``key=value`` overrides on a composed recipe (paths relative to the working directory)."""
    for item in overrides:
        key, value = parse_override(item)
        node = composed.data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
        _resolve_paths(composed.data, Path.cwd(), tuple(k for k in PATH_KEYS if k == key or k.startswith(key + ".")))
        # the override replaces the whole value: forget where its old sub-keys came from
        composed.provenance = {k: v for k, v in composed.provenance.items() if not k.startswith(key + ".")}
        leaves = list(flatten(value, key + ".")) if isinstance(value, dict) and value else [key]
        composed.provenance.update({leaf: f"override {item}" for leaf in leaves})
    return composed


def compose(recipe: str | Path, overrides: list[str] | None = None) -> Composed:
    """Compose a recipe file with its ``extends`` chain and the given overrides."""
    composed = _compose_file(Path(recipe), ())
    return apply_overrides(composed, overrides or [])
