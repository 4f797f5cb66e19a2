"""Recipe composition: YAML files, ``extends:``, presets and dotted overrides -> one plain dict.

Pure functions, no torch. Every leaf key remembers which file (and line) or override set it, so
``finetune config --provenance`` can answer "where does this value come from?". Relative file paths in
``data.train`` / ``data.eval`` / ``model.path`` / ``model.chat_template`` (a file, not a template's name) are
resolved against the directory of the file that set them (overrides: against the working directory), so a recipe
works from any working directory; so is the ``path`` of each source when ``data.train`` / ``data.eval`` is a list
of sources (or one source mapping).

Recipe YAML (files and override values alike) is read within bounds: file size, UTF-8, nesting depth, number of
values and aliases (counted as if expanded, so an alias bomb is refused before it is built), text keys only, no
duplicate keys, and the length and fan-out of ``extends:`` chains. Whatever a file holds, the result is the recipe
or one ConfigError line naming the file and line, never a traceback, a hang or a silently different recipe.
"""

from __future__ import annotations

import codecs
import copy
import re
import stat
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from finetune.config import chat_templates
from finetune.config.resources import is_recipe_name, recipe_names, recipes_dir, shipped_recipe
from finetune.config.schema import STORED_DEFAULTS, RecipeConfig
from finetune.errors import ConfigError

PATH_KEYS = ("data.train", "data.eval", "model.path", "model.chat_template")
TEMPLATE_KEY = "model.chat_template"  # a template's name, or a file's path (resolved whether or not it exists)
SOURCE_KEYS = ("data.train", "data.eval")  # a path, or a list of sources {path, ...} whose paths resolve alike
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # compressed data files (x.jsonl.gz is a jsonl file)
DATA_SUFFIXES = tuple(suffix + packed for suffix in (".jsonl", ".json", ".csv", ".parquet")
                      for packed in ("", *COMPRESSIONS))
WILDCARDS = "*?["  # a data path with one of these that names no file is a glob (no hub dataset name has them)


@dataclass
class Composed:
    """A composed recipe: the merged dict and, per dotted leaf key, where its value came from."""

    data: dict[str, Any]
    provenance: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


# --- reading recipe YAML safely ------------------------------------------------------------------------------------
# A recipe is a few dozen settings. These bounds are far above any real recipe and far below what hurts: a hostile or
# careless file must end in one ConfigError line, never a traceback, a hang or gigabytes of memory.

MAX_FILE_BYTES = 1024 * 1024  # a recipe file larger than 1 MiB is refused before it is read
MAX_NODES = 100_000  # YAML values in one document, counting each *alias as a full copy of what it refers to
MAX_ALIASES = 100  # *alias uses in one document (a "billion laughs" bomb needs many; a recipe needs a handful)
MAX_DEPTH = 32  # nesting levels of YAML values (a scalar in a section of the top-level mapping is level 3)
MAX_EXTENDS_DEPTH = 16  # files in one extends: chain, the recipe itself included
MAX_EXTENDS_FILES = 64  # file loads for one recipe, counting a base each time it is extended

# "=" is YAML 1.1's value key; PyYAML constructs it as the text "="
_TEXT_KEY_TAGS = ("tag:yaml.org,2002:str", "tag:yaml.org,2002:value")
_MERGE_TAG = "tag:yaml.org,2002:merge"  # "<<: *base" merges a mapping (explicit keys win): allowed, not a duplicate
_ALIAS_HINT = "aliases are bounded to stop 'billion laughs' expansion; write the repeated values out"


class _YamlLimit(Exception):
    """A bound broken while composing or checking a YAML document; turned into a ConfigError by :func:`_parse_yaml`.

    ``line`` is 1-based (None when unknown); the message says what is wrong and how to fix it, without the file.
    """

    def __init__(self, line: int | None, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error lines quote user input but must stay one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _line(node_or_event: Any) -> int | None:
    """The 1-based line where a YAML node or event starts (None if PyYAML gave it no position)."""
    mark = getattr(node_or_event, "start_mark", None)
    return mark.line + 1 if mark is not None else None


def _key_problem(key: yaml.Node) -> str | None:
    """Why ``key`` cannot be a recipe key (None when it is text): YAML would silently read ``1``, ``true``,
    ``null`` or ``2024-01-01`` as a number, boolean, null or date, and the key would then never match a setting."""
    if isinstance(key, yaml.ScalarNode):
        if key.tag in (*_TEXT_KEY_TAGS, _MERGE_TAG):
            return None
        if not key.value:
            return "empty key; give the setting a name"
        kind = key.tag.rsplit(":", 1)[-1]
        shown = key.value if len(key.value) <= 40 else key.value[:37] + "..."
        return f"key {shown} is read as {kind}, not text; quote it (\"{shown}\") or use a name"
    kind = "list" if isinstance(key, yaml.SequenceNode) else "mapping"
    return f"a {kind} is used as a key; keys must be plain names"


class _Loader(yaml.SafeLoader):
    """A SafeLoader that reads ``1e-3`` as a float (YAML 1.1 insists on a dot: ``1.0e-3``) and enforces the bounds
    above while it composes: nesting depth, number of values and aliases, text keys, no duplicate keys, no alias to
    an enclosing value. Nothing is expanded here: an alias composes to the very node it refers to."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._aliases = 0
        self._open_anchors: set[str] = set()  # anchors whose value is still being composed
        self._path: list[str] = []  # where we are, for messages: ["optim", "betas", "[0]"]
        self.show_lines = True  # False for an override value (one argument): no "first at line 1"
        self.root_path: list[str] = []  # the dotted key an override value goes to, for messages

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        """PyYAML's composer, plus the bounds; an alias used as a key becomes a copy placed at the alias (its line)."""
        event = self.peek_event()
        line = _line(event)
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _YamlLimit(line, f"more than {MAX_ALIASES} aliases (*name) in one document; {_ALIAS_HINT}")
            if event.anchor in self._open_anchors:
                raise _YamlLimit(line, f"alias *{event.anchor} is inside the value anchored as &{event.anchor} "
                                       "(a cycle); an alias can only repeat a complete value")
            node = super().compose_node(parent, index)
            if index is None and isinstance(parent, yaml.MappingNode):
                problem = _key_problem(node)
                if problem:
                    raise _YamlLimit(line, problem)
                node = yaml.ScalarNode(node.tag, node.value, event.start_mark, event.end_mark, style=node.style)
            return node
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _YamlLimit(line, f"more than {MAX_NODES} values in one document; a recipe holds settings, "
                                   "put large lists in a data file")
        if self._depth >= MAX_DEPTH:
            raise _YamlLimit(line, f"nested more than {MAX_DEPTH} levels deep; flatten this value")
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._open_anchors.add(anchor)
        self._depth += 1
        self._path.append(f"[{index}]" if isinstance(index, int) else str(getattr(index, "value", "?")))
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._path.pop()
            self._open_anchors.discard(anchor)  # PyYAML refuses a second &anchor of the same name
        if index is None and isinstance(parent, yaml.MappingNode):
            problem = _key_problem(node)
            if problem:
                raise _YamlLimit(_line(node), problem)
        return node

    def compose_mapping_node(self, anchor: str | None) -> yaml.MappingNode:
        """Compose a mapping and refuse a key given twice (YAML would keep the last one without a word)."""
        node = super().compose_mapping_node(anchor)
        first: dict[str, int | None] = {}
        for key, _ in node.value:  # every key is a text scalar by now: compose_node refused the others
            if key.value in first:
                where = ".".join([*self.root_path, *self._path[1:]]).replace(".[", "[")
                section = f"in {where}" if where else "at the top level"
                earlier = f" (first at line {first[key.value]})" if self.show_lines else ""
                raise _YamlLimit(_line(key), f"duplicate key {_show(key.value)} {section}{earlier}; keep one of them")
            first[key.value] = _line(key)
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """Construct one value; a value YAML matches but Python refuses (``2024-13-45``, an int of 5000 digits)
        becomes a YAML error at its line instead of a ValueError traceback."""
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError, TypeError) as exc:
            shown = _show(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            problem = f"cannot read {shown} as {node.tag.rsplit(':', 1)[-1]}: {str(exc).split(';')[0]}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


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


def _children(node: yaml.Node) -> list[yaml.Node]:
    """The nodes directly inside ``node``: list items, or the keys and values of a mapping."""
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: yaml.Node) -> int:
    """The number of values in the document with every alias expanded, computed without expanding anything.

    Refuse a document whose expanded values number more than MAX_NODES or nest deeper than MAX_DEPTH. A shared
    node's size and height are computed once (memoized by id): size(node) = 1 + the sizes of its children, height
    likewise with max. Iterative, so a long chain of aliases cannot hit the recursion limit.

    Later steps (deep copies in :func:`_merge`, :func:`flatten`, pydantic) do expand shared values, so this is
    what keeps a 600-byte "billion laughs" recipe from taking gigabytes.
    """
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    open_ids: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_ids.discard(key)
            children = _children(node)
            size[key] = min(1 + sum(size[id(c)] for c in children), MAX_NODES + 1)  # capped: no huge ints
            height[key] = 1 + max((height[id(c)] for c in children), default=0)
            if size[key] > MAX_NODES:
                raise _YamlLimit(_line(node), f"this value expands to more than {MAX_NODES} values once its aliases "
                                              f"(*name) are expanded; {_ALIAS_HINT}")
            if height[key] > MAX_DEPTH:
                raise _YamlLimit(_line(node), f"this value nests more than {MAX_DEPTH} levels deep once its aliases "
                                              f"(*name) are expanded; flatten it")
        elif key in size:
            continue  # shared and already measured
        elif key in open_ids:  # the composer refuses cycles already; this keeps the walk finite regardless
            raise _YamlLimit(_line(node), "this value contains an alias to itself (a cycle); remove the alias")
        else:
            open_ids.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(_children(node)))
    return size[id(root)]


def _parse_yaml(text: str, loader_cls: type[_Loader], where: str, show_lines: bool = True,
                invalid: str = "invalid YAML", root_path: str = "") -> tuple[Any, int]:
    """Compose ``text`` into a node graph with the bounds enforced, check its expanded size, then construct it.
    Return the value and its expanded number of values.

    Every failure is one ConfigError line prefixed with ``where`` (a file path, or ``override '...'``) and, when
    ``show_lines``, the 1-based line: ``recipe.yaml:7: duplicate key ...``. Syntax errors read ``{invalid} (...)``;
    ``root_path`` is the dotted key the text is the value of (an override's key), so messages name the full key.
    """

    def fail(line: int | None, message: str) -> ConfigError:
        return ConfigError(f"{where}{f':{line}' if show_lines and line else ''}: {message}")

    loader = None
    try:
        loader = loader_cls(text)  # the reader refuses control characters here already
        loader.show_lines = show_lines
        loader.root_path = root_path.split(".") if root_path else []
        node = loader.get_single_node()
        if node is None:
            return None, 0
        size = _check_expansion(node)
        return loader.construct_document(node), size
    except _YamlLimit as exc:
        raise fail(exc.line, exc.message) from None
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise fail(line, f"{invalid} (character U+{code:04X} is not allowed in YAML text; remove it)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise fail(mark.line + 1 if mark else None, f"{invalid} ({problem})") from None
    except RecursionError:  # the composer and constructor recurse; MAX_DEPTH should stop that first
        raise fail(None, f"nested too deeply for the YAML reader; a recipe needs at most {MAX_DEPTH} levels") \
            from None
    finally:
        if loader is not None:
            loader.dispose()


def _read_recipe_text(path: Path) -> str:
    """The text of one recipe file: a regular, readable file of at most MAX_FILE_BYTES of UTF-8 (a BOM is fine).

    The file is stat-ed before it is opened, so a FIFO or device is never opened (that could block forever), and
    a large file is never read; reading stops at MAX_FILE_BYTES + 1 bytes in case the file grew meanwhile.
    """
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{path}: recipe file not found") from None
    except PermissionError:
        raise ConfigError(f"{path}: cannot read the recipe file (permission denied); check the permissions of "
                          "the file and its folders") from None
    except (OSError, ValueError) as exc:  # a symlink loop, a name too long, an embedded NUL
        raise ConfigError(f"{path}: cannot read the recipe file ({getattr(exc, 'strerror', None) or exc})") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path}: is a directory, not a recipe file; pass the path of a .yaml recipe")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path}: is not a regular file ({_file_kind(info.st_mode)}); pass the path of a .yaml "
                          "recipe")
    if info.st_size > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: recipe file is {info.st_size} bytes, more than the {MAX_FILE_BYTES} bytes "
                          "(1 MiB) allowed; a recipe holds settings, put data in a data file")
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except PermissionError:
        raise ConfigError(f"{path}: cannot read the recipe file (permission denied); check its permissions, "
                          "e.g. chmod u+r") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the recipe file ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: recipe file is more than the {MAX_FILE_BYTES} bytes (1 MiB) allowed; "
                          "a recipe holds settings, put data in a data file")
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        offset = skip + exc.start
        line = data[:offset].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (invalid byte 0x{data[offset]:02x} at offset {offset}); "
                          "save the file as UTF-8") from None


def _file_kind(mode: int) -> str:
    """What a non-regular, non-directory file is, in words, for "is not a regular file (...)" messages."""
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def _load_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int], int]:
    """Load one YAML mapping; return it, the line of each dotted key, and its number of values (aliases expanded)."""
    raw, size = _parse_yaml(_read_recipe_text(path), _LineLoader, str(path))
    if raw is None:
        return {}, {}, 0
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping of keys, got {type(raw).__name__}")
    lines: dict[str, int] = {}
    return _strip_lines(raw, "", lines), lines, size


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


def _resolve_extends(entry: Any, owner: Path, where: str) -> Path:
    """The recipe file an ``extends:`` entry names: next to ``owner`` first, then in the shipped recipes folder
    (found by :func:`finetune.config.resources.recipes_dir`, so ``extends: presets/smoke.yaml`` works from an installed
    wheel), then, for a bare name (``quickstart``), the shipped recipe of that name, looked up as ``finetune run
    quickstart`` looks it up (:func:`finetune.config.resources.shipped_recipe`).

    ``where`` is ``owner:line`` of the ``extends:`` key, for messages. A directory or special file of that name is
    reported as such (not as "not found") unless a regular file is found in the other place.
    """
    if not isinstance(entry, str):
        raise ConfigError(f"{where}: extends: entries must be paths, got {_show(entry)}")
    other: Path | None = None
    for base in (owner.parent, recipes_dir()):
        try:
            candidate = (base / entry).resolve()
            if candidate.is_file():
                return candidate
            if other is None and candidate.exists():
                other = candidate
        except (OSError, RuntimeError, ValueError):  # a symlink loop, an embedded NUL: no such recipe here
            continue
    shipped = shipped_recipe(entry)
    if shipped is not None:  # as on the command line, a folder or special file of that name does not hide it
        return shipped.resolve()
    if other is not None:
        try:
            kind = "a directory" if other.is_dir() else f"not a regular file ({_file_kind(other.stat().st_mode)})"
        except OSError:  # gone meanwhile
            kind = "not a regular file"
        raise ConfigError(f"{where}: extends: {_show(entry)} is {kind}: {other}; name a .yaml recipe file")
    names = f", and no shipped recipe of that name (shipped: {', '.join(recipe_names()) or 'none'})" \
        if is_recipe_name(entry) else ""
    raise ConfigError(f"{where}: extends: {_show(entry)} not found relative to {owner.parent} or {recipes_dir()}"
                      f"{names}")


def _resolved(value: Any, base: Path) -> Any:
    """``value`` made absolute against ``base`` when it is a relative path that names (or looks like) a local file
    or folder, or is a glob of files; hub names, URLs, absolute paths and non-text values are returned as they are."""
    if not isinstance(value, str) or "://" in value or Path(value).is_absolute():
        return value
    try:
        candidate = (base / value).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop or a NUL: validation reports the missing file
        return value
    if candidate.exists() or value.endswith(DATA_SUFFIXES) or value.startswith(".") or \
            any(char in value for char in WILDCARDS):
        return str(candidate)
    return value


def _resolved_file(value: str, base: Path) -> str:
    """``value`` made absolute against ``base`` (absolute as given; a path the OS refuses stays as written, and
    validation reports it)."""
    if Path(value).is_absolute():
        return value
    try:
        return str((base / value).resolve())
    except (OSError, RuntimeError, ValueError):
        return value


def _resolve_paths(data: dict[str, Any], base: Path, keys: tuple[str, ...] = PATH_KEYS) -> None:
    """Make relative file paths in ``keys`` absolute against ``base`` where such a file or folder exists; in a
    list of data sources (or one source mapping), each source's ``path``."""
    for dotted in keys:
        section, key = dotted.split(".")
        if not isinstance(data.get(section), dict) or key not in data[section]:
            continue
        value = data[section][key]
        if dotted == TEMPLATE_KEY:  # a path (not a name) names a file whether or not it exists yet
            if isinstance(value, str) and value.strip() and not chat_templates.is_name(value):
                data[section][key] = _resolved_file(value, base)
        elif dotted in SOURCE_KEYS and isinstance(value, list | dict):
            sources = value if isinstance(value, list) else [value]
            for source in sources:
                if isinstance(source, dict) and "path" in source:
                    source["path"] = _resolved(source["path"], base)
        else:
            data[section][key] = _resolved(value, base)


@dataclass
class _Loaded:
    """What one :func:`compose` has loaded so far: a diamond of bases, each extending the next one twice, would
    otherwise load 2**depth files, each up to MAX_NODES values, and merge them all."""

    files: int = 0
    nodes: int = 0


def _compose_file(path: Path, chain: tuple[Path, ...], loaded: _Loaded, via: str = "") -> Composed:
    """Compose one file over its ``extends:`` bases. ``chain`` holds the files that extend this one (for cycles
    and the depth bound), ``loaded`` counts the files and values loaded for this recipe, ``via`` is the
    ``file:line`` of the ``extends:`` that names this file."""
    try:
        path = path.resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot resolve the recipe path ({exc})") from None
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"extends: cycle {cycle}")
    via = via or str(path)
    if len(chain) >= MAX_EXTENDS_DEPTH:
        names = " -> ".join(p.name for p in (*chain, path))
        raise ConfigError(f"{via}: extends: more than {MAX_EXTENDS_DEPTH} files deep ({names}); merge some of the "
                          "bases into one file")
    loaded.files += 1
    if loaded.files > MAX_EXTENDS_FILES:
        raise ConfigError(f"{via}: extends: more than {MAX_EXTENDS_FILES} files loaded for one recipe (a base counts "
                          "each time it is extended); merge some of the bases into one file")
    raw, lines, size = _load_yaml(path)
    loaded.nodes += size
    if loaded.nodes > MAX_NODES:
        raise ConfigError(f"{via}: extends: the recipe and its bases hold more than {MAX_NODES} values in all (a "
                          "base counts each time it is extended); merge some of the bases into one file")
    where = f"{path}:{lines['extends']}" if "extends" in lines else str(path)
    extends = raw.pop("extends", [])
    extends = [extends] if isinstance(extends, str) else extends
    if not isinstance(extends, list):
        raise ConfigError(f"{where}: extends: must be a path or a list of paths")
    merged = Composed(data={})
    for entry in extends:
        parent = _compose_file(_resolve_extends(entry, path, where), (*chain, path), loaded, where)
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
    return any(a is str or (get_origin(a) is Literal and all(isinstance(v, str) for v in get_args(a)))
               for a in _options(annotation))


def _options(annotation: Any) -> list[Any]:
    """The member types of a (possibly nested, possibly Annotated) union; ``[annotation]`` for a plain type."""
    if get_origin(annotation) is Annotated:
        return _options(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return [member for arg in get_args(annotation) for member in _options(arg)]
    return [annotation]


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``a.b=c``; the value is YAML-parsed unless the schema types the key as a string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    label = f"override {_show(item)}"
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"{label}: expected key.path=value, e.g. train.max_steps=50")
    if key.count(".") >= MAX_DEPTH:
        raise ConfigError(f"{label}: the key has more than {MAX_DEPTH} parts; recipe keys are a few levels deep")
    # data.train / data.eval: a path stays verbatim, a YAML list or mapping is a list of sources
    sources = key in SOURCE_KEYS and raw.lstrip().startswith(("[", "{"))
    if _field_is_text(key) and raw not in ("null", "~", "") and not sources:
        return key, raw
    if not raw:
        return key, None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{label}: value is longer than {MAX_FILE_BYTES} characters; put it in the recipe file")
    # the same bounds as a recipe file (aliases, size, depth, keys), without line numbers: it is one argument
    value, _ = _parse_yaml(raw, _Loader, label, show_lines=False, invalid="value is not valid YAML", root_path=key)
    return key, value


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
    composed = _compose_file(Path(recipe), (), _Loaded())
    return apply_overrides(composed, overrides or [])


def compose_stored(recipe: str | Path, overrides: list[str] | None = None) -> Composed:
    """Compose a recipe finetune wrote (a run's, checkpoint's or export's recipe.resolved.yaml) with the given
    overrides. A key of :data:`finetune.config.schema.STORED_DEFAULTS` the file lacks was added after the run was
    trained: it is read with the value the run was trained with, not today's default (an older run resumes,
    evaluates and generates as it trained)."""
    composed = _compose_file(Path(recipe), (), _Loaded())
    present = flatten(composed.data)
    for key, value in STORED_DEFAULTS.items():
        *sections, leaf = key.split(".")
        node = composed.data
        for part in sections:
            node = node.get(part) if isinstance(node, dict) else None
        if key not in present and isinstance(node, dict):
            node[leaf] = value
            composed.provenance[key] = "stored recipe written before this key existed"
    return apply_overrides(composed, overrides or [])
