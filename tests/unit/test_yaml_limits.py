"""Hostile or careless recipe YAML: every such recipe ends in one ConfigError line naming the file (and line), never
a traceback, a hang, gigabytes of memory, or a silently different recipe.

Covers duplicate keys, alias bombs and alias cycles, nesting depth (ours and PyYAML's recursion), file size,
encoding, paths that are not regular readable files, non-text keys, ``extends:`` chains and fan-out, and dotted
overrides; a few cases also go through the real CLI entry point, which must print only ``error: ...`` lines and
exit with code 2. Pure config code: no torch.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from finetune.config.compose import (
    MAX_ALIASES,
    MAX_DEPTH,
    MAX_EXTENDS_DEPTH,
    MAX_EXTENDS_FILES,
    MAX_FILE_BYTES,
    MAX_NODES,
    compose,
    parse_override,
)
from finetune.errors import ConfigError
from tests.cli_helpers import assert_user_error, main_exit

compose_module = importlib.import_module("finetune.config.compose")  # the package's ``compose`` is the function

ALIAS_HINT = "aliases are bounded to stop 'billion laughs' expansion; write the repeated values out"


pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def write(folder: Path, content: str | bytes, name: str = "recipe.yaml") -> Path:
    """Write ``content`` verbatim (str as UTF-8) to ``folder/name``; return the resolved path (as messages show it)."""
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path.resolve()


def compose_error(recipe: Path, overrides: list[str] | None = None) -> str:
    """The message of the ConfigError that composing ``recipe`` raises; it must be a single line."""
    with pytest.raises(ConfigError) as info:
        compose(recipe, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def override_error(item: str) -> str:
    """The single-line message of the ConfigError that parsing the override ``item`` raises."""
    with pytest.raises(ConfigError) as info:
        parse_override(item)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail with TimeoutError instead of hanging the test run (e.g. when a FIFO gets opened for reading)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def stack_depth() -> int:
    """How many Python frames are on the stack here."""
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def shown(item: str) -> str:
    """How an error line quotes user input: its repr, cut to 80 characters."""
    return repr(item) if len(repr(item)) <= 80 else repr(item)[:77] + "..."


def nested_list(levels: int, leaf: str = "1") -> str:
    """``[[[...leaf...]]]`` with ``levels`` brackets, in flow style on one line."""
    return "[" * levels + leaf + "]" * levels


def laughs(levels: int = 9) -> str:
    """The "billion laughs" recipe: each anchor is a list of ten aliases of the one before (10**levels strings)."""
    names = [f"lol{i}" for i in range(levels + 1)]
    lines = [f'{names[0]}: &{names[0]} "lol"']
    lines += [f"{name}: &{name} [" + ",".join([f"*{prev}"] * 10) + "]" for prev, name in itertools.pairwise(names)]
    return "\n".join(lines) + "\n"


# --- 1. duplicate keys, at any level, in block and flow style ---------------------------------------------------

DUPLICATES = {
    "top level": ("name: a\nname: b\n", 2, "'name' at the top level", 1),
    "whole section twice": ("train:\n  max_steps: 1\neval:\n  every_steps: 1\ntrain:\n  seed: 2\n", 5,
                            "'train' at the top level", 1),
    "block mapping": ("optim:\n  lr: 1\n  weight_decay: 0\n  lr: 2\n", 4, "'lr' in optim", 2),
    "flow mapping": ("optim: {lr: 1, lr: 2}\n", 1, "'lr' in optim", 1),
    "quoted and plain": ('optim:\n  "lr": 1\n  lr: 2\n', 3, "'lr' in optim", 2),
    "nested section": ("model:\n  config_overrides:\n    hidden_size: 8\n    hidden_size: 16\n", 4,
                       "'hidden_size' in model.config_overrides", 3),
    "list of block mappings": ("data:\n  items:\n    - {a: 1}\n    - a: 1\n      b: 2\n      a: 3\n", 6,
                               "'a' in data.items[1]", 4),
    "flow mapping in a flow list": ("x: [{a: 1}, {b: 1, b: 2}]\n", 1, "'b' in x[1]", 1),
    "alias as a key": ("k: &k lr\noptim:\n  lr: 1\n  *k : 2\n", 4, "'lr' in optim", 3),
}


@pytest.mark.parametrize(("text", "line", "what", "first"), DUPLICATES.values(), ids=DUPLICATES.keys())
def test_duplicate_key_names_file_line_key_and_first_line(tmp_path, text, line, what, first):
    path = write(tmp_path, text)
    assert compose_error(path) == f"{path}:{line}: duplicate key {what} (first at line {first}); keep one of them"


def test_duplicate_key_in_a_base_names_the_base(tmp_path):
    base = write(tmp_path, "optim:\n  lr: 1\n  lr: 2\n", "base.yaml")
    recipe = write(tmp_path, "extends: base.yaml\nname: x\n")
    assert compose_error(recipe) == f"{base}:3: duplicate key 'lr' in optim (first at line 2); keep one of them"


def test_same_key_in_different_mappings_and_merge_keys_are_not_duplicates(tmp_path):
    path = write(tmp_path, "base: &b {lr: 1, weight_decay: 2}\noptim:\n  <<: *b\n  lr: 3\nother: {lr: 4}\n")
    assert compose(path).data == {"base": {"lr": 1, "weight_decay": 2}, "optim": {"lr": 3, "weight_decay": 2},
                                  "other": {"lr": 4}}


# --- 2. aliases: bombs, too many, cycles, depth through aliases -----------------------------------------------------


def measured(fn: Callable[[], str]) -> tuple[str, float, int]:
    """``fn()``'s result, the seconds it took and the peak of memory traced meanwhile."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = fn()
        return result, time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_billion_laughs_fails_fast_in_little_memory(tmp_path):
    path = write(tmp_path, laughs())
    assert path.stat().st_size < 700  # a few hundred bytes that would expand to 10**9 strings and lists
    message, elapsed, peak = measured(lambda: compose_error(path))
    # lol5 is the first anchor over the bound: 1 + 10 * (1 + 10 * (...)) = 111111 values
    assert message == (f"{path}:6: this value expands to more than {MAX_NODES} values once its aliases (*name) are "
                       f"expanded; {ALIAS_HINT}")
    assert elapsed < 2, elapsed
    assert peak < 50 * 2**20, peak


def test_more_than_max_aliases_is_refused(tmp_path):
    path = write(tmp_path, "s: &s x\nl: [" + ", ".join(["*s"] * (MAX_ALIASES + 1)) + "]\n")
    assert compose_error(path) == f"{path}:2: more than {MAX_ALIASES} aliases (*name) in one document; {ALIAS_HINT}"


def test_a_few_aliases_still_work_and_share_values(tmp_path):
    path = write(tmp_path, "s: &s x\nl: [" + ", ".join(["*s"] * MAX_ALIASES) + "]\nd: &d {a: 1}\n")
    assert compose(path).data == {"s": "x", "l": ["x"] * MAX_ALIASES, "d": {"a": 1}}


@pytest.mark.parametrize("text", ["a: &x {b: *x}\n", "a: &x [1, *x]\n", "a: &x {b: [c, {d: *x}]}\n",
                                  "a: &x\n  b: *x\n"])
def test_alias_cycle_is_refused(tmp_path, text):
    path = write(tmp_path, text)
    line = 2 if "\n  " in text else 1
    assert compose_error(path) == (f"{path}:{line}: alias *x is inside the value anchored as &x (a cycle); an alias "
                                   "can only repeat a complete value")


def test_depth_through_aliases_is_bounded(tmp_path):
    # each document line is 21 levels deep, but *a puts one inside the other: 2 + 20 + 21 levels once expanded
    path = write(tmp_path, f"a: &a {nested_list(20)}\nb: {nested_list(20, '*a')}\n")
    assert compose_error(path) == (f"{path}:2: this value nests more than {MAX_DEPTH} levels deep once its aliases "
                                   "(*name) are expanded; flatten it")


def test_too_many_values_without_aliases_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(compose_module, "MAX_NODES", 1000)  # the real bound takes seconds of pure-Python parsing
    path = write(tmp_path, "x:\n" + "".join(f"  - {i}\n" for i in range(1000)))
    # the mapping, the key x and the list are values 1 to 3, so "- 997" on line 999 is value 1001
    assert compose_error(path) == (f"{path}:999: more than 1000 values in one document; a recipe holds settings, "
                                   "put large lists in a data file")


# --- 3. depth ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "line"), [
    (f"x: {nested_list(5000)}\n", 1),
    ("x: " + "[" * 100_000 + "\n", 1),  # unclosed too: refused at level 33, long before the syntax error
    ("".join("  " * i + f"k{i}:\n" for i in range(40)) + "  " * 40 + "v\n", 32),  # block mappings
    ("x:\n" + "".join("  " * i + "- \n" for i in range(1, 40)) + "  " * 40 + "- 1\n", 33),  # block lists
], ids=["flow lists", "unclosed flow lists", "block mappings", "block lists"])
def test_deep_nesting_is_one_line(tmp_path, text, line):
    path = write(tmp_path, text)
    assert compose_error(path) == f"{path}:{line}: nested more than {MAX_DEPTH} levels deep; flatten this value"


def test_nesting_up_to_the_bound_is_fine(tmp_path):
    # root mapping (level 1), x's list (2) ... innermost scalar at level MAX_DEPTH
    path = write(tmp_path, f"x: {nested_list(MAX_DEPTH - 2)}\n")
    value = compose(path).data["x"]
    for _ in range(MAX_DEPTH - 2):
        value = value[0]
    assert value == 1
    path = write(tmp_path, f"x: {nested_list(MAX_DEPTH - 1)}\n")
    assert "nested more than" in compose_error(path)


@pytest.mark.parametrize("where", ["file", "override"])
def test_recursion_error_from_pyyaml_becomes_a_config_error(tmp_path, where):
    """PyYAML's composer recurses per level; with little stack left it raises RecursionError, which must be one line."""
    text = nested_list(MAX_DEPTH - 3)
    path = write(tmp_path, f"x: {text}\n")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(stack_depth() + 45)  # enough to reach the parser, not for ~30 levels of composing
    try:
        with pytest.raises(ConfigError) as info:
            compose(path) if where == "file" else parse_override(f"x={text}")
    finally:
        sys.setrecursionlimit(limit)
    label = str(path) if where == "file" else f"override 'x={text}'"
    assert str(info.value) == (f"{label}: nested too deeply for the YAML reader; a recipe needs at most {MAX_DEPTH} "
                               "levels")


# --- 4. size --------------------------------------------------------------------------------------------------------


def test_file_over_1_mib_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = write(tmp_path, "name: x\n#" + "-" * (MAX_FILE_BYTES - 9) + "\n")
    assert path.stat().st_size == MAX_FILE_BYTES + 1

    def no_reading(self: Path, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{self} was opened")

    monkeypatch.setattr(Path, "open", no_reading)
    monkeypatch.setattr(Path, "read_bytes", no_reading)
    monkeypatch.setattr(Path, "read_text", no_reading)
    assert compose_error(path) == (f"{path}: recipe file is {MAX_FILE_BYTES + 1} bytes, more than the "
                                   f"{MAX_FILE_BYTES} bytes (1 MiB) allowed; a recipe holds settings, put data in a "
                                   "data file")


def test_file_of_exactly_1_mib_is_read(tmp_path):
    path = write(tmp_path, "name: x\n#" + "-" * (MAX_FILE_BYTES - 10) + "\n")
    assert path.stat().st_size == MAX_FILE_BYTES
    assert compose(path).data == {"name": "x"}


# --- 5. encoding ------------------------------------------------------------------------------------------------

NOT_UTF8 = {
    "invalid bytes": (b"name: x\nmodel: \xff\xfe\n", 2, 0xFF, 15),
    "latin-1": (b"name: caf\xe9\n", 1, 0xE9, 9),
    "utf-16": ("name: x\n".encode("utf-16"), 1, 0xFF, 0),
    "bad byte after a BOM": (b"\xef\xbb\xbfname: x\nmodel: \xc3\x28\n", 2, 0xC3, 18),
    "truncated at the end": (b"name: \xe2\x82", 1, 0xE2, 6),
}


@pytest.mark.parametrize(("content", "line", "byte", "offset"), NOT_UTF8.values(), ids=NOT_UTF8.keys())
def test_not_utf8_names_file_line_byte_and_offset(tmp_path, content, line, byte, offset):
    path = write(tmp_path, content)
    assert compose_error(path) == (f"{path}:{line}: not UTF-8 text (invalid byte 0x{byte:02x} at offset {offset}); "
                                   "save the file as UTF-8")


def test_utf8_bom_is_accepted_and_lines_stay_right(tmp_path):
    path = write(tmp_path, b"\xef\xbb\xbf# comment\nname: caf\xc3\xa9\noptim: {lr: 1e-3}\n")
    composed = compose(path)
    assert composed.data == {"name": "café", "optim": {"lr": 1e-3}}
    assert composed.provenance["name"].endswith("recipe.yaml:2")
    assert composed.provenance["optim.lr"].endswith("recipe.yaml:3")


@pytest.mark.parametrize(("content", "code"), [("name: a\x07b\n", "0007"), ("name: x\nmodel: a\x00b\n", "0000")])
def test_control_character_names_the_line(tmp_path, content, code):
    path = write(tmp_path, content)
    line = content.count("\n", 0, content.index("\x07" if code == "0007" else "\x00")) + 1
    assert compose_error(path) == (f"{path}:{line}: invalid YAML (character U+{code} is not allowed in YAML text; "
                                   "remove it)")


@pytest.mark.parametrize(("content", "problem"), [
    ("train:\n  seed: 2024-13-45\n", "cannot read '2024-13-45' as timestamp: month must be in 1..12"),
    ("train:\n  seed: " + "1" * 5000 + "\n", "cannot read '" + "1" * 76),
])
def test_value_python_cannot_hold_is_a_config_error(tmp_path, content, problem):
    path = write(tmp_path, content)
    message = compose_error(path)
    assert message.startswith(f"{path}:2: invalid YAML ({problem}"), message
    assert len(message) < 300


# --- 6. not a regular readable file ------------------------------------------------------------------------------


def test_recipe_that_is_a_directory(tmp_path):
    folder = (tmp_path / "recipes.yaml").resolve()
    folder.mkdir()
    assert compose_error(folder) == f"{folder}: is a directory, not a recipe file; pass the path of a .yaml recipe"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_recipe_that_is_a_named_pipe_is_never_opened(tmp_path):
    fifo = (tmp_path / "recipe.yaml").resolve()
    os.mkfifo(fifo)
    with deadline(5):  # opening a FIFO for reading blocks until a writer comes: it must not be opened
        message = compose_error(fifo)
    assert message == f"{fifo}: is not a regular file (a named pipe); pass the path of a .yaml recipe"


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
def test_recipe_that_is_a_device():
    assert compose_error(Path("/dev/null")) == ("/dev/null: is not a regular file (a character device); pass the "
                                                "path of a .yaml recipe")


def test_unreadable_recipe(tmp_path, monkeypatch):
    path = write(tmp_path, "name: x\n")
    real_open = Path.open

    def denied(self: Path, *args: object, **kwargs: object) -> object:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    assert compose_error(path) == (f"{path}: cannot read the recipe file (permission denied); check its "
                                   "permissions, e.g. chmod u+r")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_recipe_for_real(tmp_path):
    path = write(tmp_path, "name: x\n")
    path.chmod(0)
    try:
        assert "cannot read the recipe file (permission denied)" in compose_error(path)
    finally:
        path.chmod(0o600)


def test_symlink_loop(tmp_path):
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    message = compose_error(tmp_path / "a.yaml")
    assert message.startswith(f"{tmp_path / 'a.yaml'}: cannot ") and "loop" in message.lower(), message


# --- 7. non-text keys --------------------------------------------------------------------------------------------

BAD_KEYS = {
    "int": ("1: x\n", 1, 'key 1 is read as int, not text; quote it ("1") or use a name'),
    "float in a section": ("optim:\n  1e-3: x\n", 2, 'key 1e-3 is read as float, not text; quote it ("1e-3") or use '
                                                     "a name"),
    "null": ("null: 3\n", 1, 'key null is read as null, not text; quote it ("null") or use a name'),
    "tilde": ("~: 3\n", 1, 'key ~ is read as null, not text; quote it ("~") or use a name'),
    "empty": ("? \n: 3\n", 1, "empty key; give the setting a name"),
    "true": ("true: 1\n", 1, 'key true is read as bool, not text; quote it ("true") or use a name'),
    "on (YAML 1.1 bool)": ("on: 1\n", 1, 'key on is read as bool, not text; quote it ("on") or use a name'),
    "date": ("2024-01-01: x\n", 1, 'key 2024-01-01 is read as timestamp, not text; quote it ("2024-01-01") or use '
                                   "a name"),
    "list": ("? [a, b]\n: c\n", 1, "a list is used as a key; keys must be plain names"),
    "mapping": ("? {a: 1}\n: c\n", 1, "a mapping is used as a key; keys must be plain names"),
    "flow mapping in a list": ("x: [{a: 1}, {0: b}]\n", 1, 'key 0 is read as int, not text; quote it ("0") or use a '
                                                          "name"),
    "alias of a list": ("k: &l [a]\n*l : 1\n", 2, "a list is used as a key; keys must be plain names"),
}


@pytest.mark.parametrize(("text", "line", "problem"), BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_non_text_key_names_file_and_line(tmp_path, text, line, problem):
    path = write(tmp_path, text)
    assert compose_error(path) == f"{path}:{line}: {problem}"


def test_quoted_keys_are_text(tmp_path):
    assert compose(write(tmp_path, "'1': x\n\"true\": 1\n'null': 2\n")).data == {"1": "x", "true": 1, "null": 2}


# --- 8. extends: depth, fan-out, the same checks in every file, directories -------------------------------------


def test_extends_chain_up_to_the_bound_works_one_more_is_refused(tmp_path):
    files = [write(tmp_path, f"extends: r{i + 1}.yaml\nk{i}: {i}\n", f"r{i}.yaml") for i in range(MAX_EXTENDS_DEPTH)]
    write(tmp_path, "last: true\n", f"r{MAX_EXTENDS_DEPTH}.yaml")
    assert len(compose(files[1]).files) == MAX_EXTENDS_DEPTH
    names = " -> ".join(f"r{i}.yaml" for i in range(MAX_EXTENDS_DEPTH + 1))
    assert compose_error(files[0]) == (f"{files[-1]}:1: extends: more than {MAX_EXTENDS_DEPTH} files deep ({names}); "
                                       "merge some of the bases into one file")


def test_extends_fan_out_is_bounded_by_files(tmp_path):
    for i in range(7):  # each file extends the next one twice: 2**7 loads
        write(tmp_path, f"extends: [l{i + 1}.yaml, l{i + 1}.yaml]\nk{i}: 1\n", f"l{i}.yaml")
    write(tmp_path, "leaf: 1\n", "l7.yaml")
    start = time.perf_counter()
    message = compose_error(tmp_path / "l0.yaml")
    assert re.fullmatch(rf"{re.escape(str(tmp_path.resolve()))}/l\d\.yaml:1: extends: more than {MAX_EXTENDS_FILES} "
                        r"files loaded for one recipe \(a base counts each time it is extended\); merge some of the "
                        r"bases into one file", message), message
    assert time.perf_counter() - start < 5


def test_extends_fan_out_is_bounded_by_values(tmp_path):
    # a base that is just under the bound, extended twice: 2 x ~90k values
    base = "a: &a {k0: 1, k1: 2, k2: 3, k3: 4}\n" + "".join(
        f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]\n" for prev, name in itertools.pairwise("abcd"))
    write(tmp_path, base + "e: [" + ", ".join(["*d"] * 8) + "]\n", "big.yaml")
    recipe = write(tmp_path, "extends: [big.yaml, big.yaml]\n")
    assert compose_error(recipe) == (f"{recipe}:1: extends: the recipe and its bases hold more than {MAX_NODES} "
                                     "values in all (a base counts each time it is extended); merge some of the bases "
                                     "into one file")


BAD_BASES = {
    "duplicate key": ("optim: {lr: 1, lr: 2}\n", "1: duplicate key 'lr' in optim (first at line 1); keep one of them"),
    "not UTF-8": (b"name: \xff\n", "1: not UTF-8 text (invalid byte 0xff at offset 6); save the file as UTF-8"),
    "alias bomb": (laughs(), f"6: this value expands to more than {MAX_NODES} values once its aliases (*name) are "
                             f"expanded; {ALIAS_HINT}"),
    "too deep": (f"x: {nested_list(100)}\n", f"1: nested more than {MAX_DEPTH} levels deep; flatten this value"),
    "non-text key": ("1: x\n", '1: key 1 is read as int, not text; quote it ("1") or use a name'),
    "too large": ("#" * (MAX_FILE_BYTES + 1), f" recipe file is {MAX_FILE_BYTES + 1} bytes, more than the "
                                              f"{MAX_FILE_BYTES} bytes (1 MiB) allowed; a recipe holds settings, put "
                                              "data in a data file"),
}


@pytest.mark.parametrize(("content", "expected"), BAD_BASES.values(), ids=BAD_BASES.keys())
def test_every_file_of_an_extends_chain_gets_the_same_checks(tmp_path, content, expected):
    base = write(tmp_path, content, "bases/bad.yaml")
    write(tmp_path, "extends: bases/bad.yaml\n", "middle.yaml")
    recipe = write(tmp_path, "name: x\nextends: [middle.yaml]\n")
    assert compose_error(recipe) == f"{base}:{expected}"


def test_extends_entry_that_is_a_directory(tmp_path):
    (tmp_path / "presets").mkdir()
    write(tmp_path, "name: ok\n", "ok.yaml")
    recipe = write(tmp_path, "name: x\nextends: [ok.yaml, presets]\n")
    folder = (tmp_path / "presets").resolve()
    assert compose_error(recipe) == f"{recipe}:2: extends: 'presets' is a directory: {folder}; name a .yaml recipe file"


def test_extends_empty_path_is_the_directory_not_a_crash(tmp_path):
    recipe = write(tmp_path, 'extends: ""\n')
    assert compose_error(recipe) == (f"{recipe}:1: extends: '' is a directory: {tmp_path.resolve()}; name a .yaml "
                                     "recipe file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_extends_entry_that_is_a_named_pipe(tmp_path):
    os.mkfifo(tmp_path / "pipe.yaml")
    recipe = write(tmp_path, "extends: pipe.yaml\n")
    with deadline(5):
        message = compose_error(recipe)
    assert message == (f"{recipe}:1: extends: 'pipe.yaml' is not a regular file (a named pipe): "
                       f"{(tmp_path / 'pipe.yaml').resolve()}; name a .yaml recipe file")


def test_extends_entry_with_a_nul_byte_is_not_found(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_RECIPES_DIR", str(tmp_path / "shipped"))
    recipe = write(tmp_path, 'extends: "a\\0b.yaml"\n')
    assert compose_error(recipe) == (f"{recipe}:1: extends: 'a\\x00b.yaml' not found relative to {tmp_path.resolve()} "
                                     f"or {tmp_path / 'shipped'}")


# --- 9. dotted overrides --------------------------------------------------------------------------------------------

# each anchor is a list of two aliases of the one before: 2**17 values from a 300-character argument
OVERRIDE_BOMB = "x=[&a [1,1], " + ", ".join(f"&{b} [*{a},*{a}]" for a, b in itertools.pairwise("abcdefghijklmnopqr"))
OVERRIDE_BOMB += "]"


def test_override_alias_bomb_fails_fast_in_little_memory():
    message, elapsed, peak = measured(lambda: override_error(OVERRIDE_BOMB))
    assert message == (f"override {shown(OVERRIDE_BOMB)}: this value expands to more than {MAX_NODES} values once "
                       f"its aliases (*name) are expanded; {ALIAS_HINT}")
    assert elapsed < 2 and peak < 50 * 2**20, (elapsed, peak)


@pytest.mark.parametrize(("item", "problem"), [
    ("x=[" + ", ".join(["&a 1"] + ["*a"] * (MAX_ALIASES + 1)) + "]",
     f"more than {MAX_ALIASES} aliases (*name) in one document; {ALIAS_HINT}"),
    ("x=" + nested_list(5000), f"nested more than {MAX_DEPTH} levels deep; flatten this value"),
    ("x=" + "[" * 5000, f"nested more than {MAX_DEPTH} levels deep; flatten this value"),
    ("x=&a [*a]", "alias *a is inside the value anchored as &a (a cycle); an alias can only repeat a complete value"),
    ("optim={lr: 1, lr: 2}", "duplicate key 'lr' in optim; keep one of them"),
    ("x={a: [{b: 1, b: 2}]}", "duplicate key 'b' in x.a[0]; keep one of them"),
    ("model.config_overrides={1: 2}", 'key 1 is read as int, not text; quote it ("1") or use a name'),
    ("x={null: 1}", 'key null is read as null, not text; quote it ("null") or use a name'),
    ("a." * MAX_DEPTH + "b=1", f"the key has more than {MAX_DEPTH} parts; recipe keys are a few levels deep"),
], ids=["aliases", "deep", "deep unclosed", "cycle", "duplicate", "duplicate in a list", "int key", "null key",
        "key too deep"])
def test_override_values_get_the_same_bounds(item, problem):
    assert override_error(item) == f"override {shown(item)}: {problem}"


def test_override_with_too_many_values(monkeypatch):
    monkeypatch.setattr(compose_module, "MAX_NODES", 1000)  # the real bound takes seconds of pure-Python parsing
    item = "x=[" + ",".join(["0"] * 1000) + "]"
    assert override_error(item) == (f"override {shown(item)}: more than 1000 values in one document; a recipe holds "
                                    "settings, put large lists in a data file")


def test_override_bounds_apply_through_compose(tmp_path):
    recipe = write(tmp_path, "name: x\n")
    assert compose_error(recipe, ["optim={lr: 1, lr: 2}"]) == ("override 'optim={lr: 1, lr: 2}': duplicate key 'lr' "
                                                               "in optim; keep one of them")


def test_invalid_override_yaml_still_says_so():
    assert override_error("eval.metrics=[exact_match,").startswith(
        "override 'eval.metrics=[exact_match,': value is not valid YAML (")


# --- 10. what worked keeps working ---------------------------------------------------------------------------------


def test_ordinary_recipe_with_anchors_extends_and_exponents_composes(tmp_path):
    write(tmp_path, "optim: {lr: 1e-3, weight_decay: 0.0}\n", "base.yaml")
    recipe = write(tmp_path, "# a recipe\nextends: base.yaml\nname: ok\ndefaults: &d {seed: 3}\n"
                             "train:\n  <<: *d\n  max_steps: 2\n", "recipe.yaml")
    composed = compose(recipe, ["optim.lr=5e-4", "model.config_overrides={hidden_size: 32}"])
    assert composed.data["optim"] == {"lr": 5e-4, "weight_decay": 0.0}
    assert composed.data["train"] == {"seed": 3, "max_steps": 2}
    assert composed.data["model"] == {"config_overrides": {"hidden_size": 32}}
    assert composed.provenance["name"].endswith("recipe.yaml:3")
    assert composed.provenance["train.max_steps"].endswith("recipe.yaml:7")
    assert composed.provenance["optim.weight_decay"].endswith("base.yaml:1")


# --- end to end through the CLI ----------------------------------------------------------------------------------

CLI_CASES = {
    "duplicate key": ("name: a\nname: b\n", "recipe.yaml:2: duplicate key 'name' at the top level (first at line 1)"),
    "alias bomb": (laughs(), f"recipe.yaml:6: this value expands to more than {MAX_NODES} values"),
    "deep": (f"x: {nested_list(5000)}\n", f"recipe.yaml:1: nested more than {MAX_DEPTH} levels deep"),
    "not UTF-8": (b"name: \xff\n", "recipe.yaml:1: not UTF-8 text (invalid byte 0xff at offset 6)"),
    "non-text key": ("true: 1\n", "recipe.yaml:1: key true is read as bool, not text"),
    "extends a directory": ("extends: .\n", "recipe.yaml:1: extends: '.' is a directory"),
}


@pytest.mark.parametrize(("content", "needle"), CLI_CASES.values(), ids=CLI_CASES.keys())
def test_cli_prints_one_error_line(tmp_path, monkeypatch, capsys, content, needle):
    path = write(tmp_path, content)
    start = time.perf_counter()
    lines = assert_user_error(*main_exit(monkeypatch, capsys, "config", str(path)), needle)
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}:"), lines
    assert time.perf_counter() - start < 5


def test_cli_recipe_that_is_a_directory(tmp_path, monkeypatch, capsys):
    lines = assert_user_error(*main_exit(monkeypatch, capsys, "config", str(tmp_path)), "is a directory")
    assert lines == [f"error: {tmp_path.resolve()}: is a directory, not a recipe file; pass the path of a .yaml recipe"]


def test_cli_override_alias_bomb(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, "name: x\n")
    lines = assert_user_error(*main_exit(monkeypatch, capsys, "config", str(path), OVERRIDE_BOMB),
                              f"expands to more than {MAX_NODES} values")
    assert len(lines) == 1 and lines[0].startswith("error: override 'x=[&a"), lines

