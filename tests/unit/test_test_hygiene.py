"""The test suite's own rules, checked by reading its source (no test runs another): one recipe writer, one autouse
reset of shared process state, no two fixtures with one name, and no issue numbers in code or tests.

Why: a second recipe writer drifts (one sorted its keys, one did not); a copied autouse reset is forgotten in the
next module that needs it; two fixtures with one name make ``def test_x(run)`` mean different things in different
folders, and a conftest fixture silently shadowed by a module's; an issue number says nothing to a reader of the
code (the test or comment should say what is proved). Each check parses every ``.py`` under tests/ with ``ast`` (the
issue check reads the package, tests and scripts as text); nothing is imported or run. """

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
ISSUE = re.compile(r"\bissues? #?[0-9]+", re.IGNORECASE)
WRITER = "recipe_files.py"  # tests/recipe_files.py: the one module that dumps YAML
SHARED_RESET = "conftest.py"  # tests/conftest.py: the one autouse reset (_fresh_process)
# What the shared reset owns: a module's own autouse fixture must not touch it again.
SHARED_STATE = ("hooks.clear", "chdir", "LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_LAUNCHED", "LOCAL_WORLD_SIZE",
                "FINETUNE_DEBUG", "FINETUNE_RECIPES_DIR", "HF_HUB_OFFLINE", "FINETUNE_DERIVED_SAID")
YAML_DUMPS = ("dump", "safe_dump", "dump_all", "safe_dump_all")


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path`` parsed, once per session (the checks below read each file; parsing is their whole cost)."""
    return ast.parse(path.read_text(), str(path))


def _fixture_call(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.expr | None:
    """The ``@pytest.fixture`` / ``@pytest.fixture(...)`` decorator of ``fn``, if it has one."""
    for deco in fn.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target) in ("pytest.fixture", "fixture"):
            return deco
    return None


def _keyword(deco: ast.expr, name: str) -> object:
    """The constant value of keyword ``name`` in a ``@pytest.fixture(...)`` call (None when absent)."""
    if isinstance(deco, ast.Call):
        for kw in deco.keywords:
            if kw.arg == name and isinstance(kw.value, ast.Constant):
                return kw.value.value
    return None


def _fixtures(root: Path) -> list[tuple[str, Path, ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """Every fixture defined under ``root`` (at module level or in a test class, where pytest finds them): (its
    name as pytest sees it, file, def, autouse)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        body = _tree(path).body
        for node in [*body, *(item for cls in body if isinstance(cls, ast.ClassDef) for item in cls.body)]:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (deco := _fixture_call(node)) is not None:
                found.append((str(_keyword(deco, "name") or node.name), path, node, bool(_keyword(deco, "autouse"))))
    return found


def fixture_name_clashes(root: Path) -> dict[str, list[str]]:
    """Fixture names defined more than once under ``root``, with where (``path:line``)."""
    where: dict[str, list[str]] = defaultdict(list)
    for name, path, node, _ in _fixtures(root):
        where[name].append(f"{path.relative_to(root)}:{node.lineno}")
    return {name: places for name, places in where.items() if len(places) > 1}


def yaml_writers(root: Path) -> list[str]:
    """``path:line`` of every YAML dump under ``root`` outside the one writer (tests/recipe_files.py): a call of
    ``yaml.safe_dump`` / ``dump`` (``_all`` too), through ``import yaml [as y]`` or ``from yaml import ... [as d]``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) == Path(WRITER):
            continue
        tree = _tree(path)
        modules, functions = {"yaml"}, set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {alias.asname for alias in node.names if alias.name == "yaml" and alias.asname}
            elif isinstance(node, ast.ImportFrom) and node.module == "yaml":
                functions |= {alias.asname or alias.name for alias in node.names if alias.name in YAML_DUMPS}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Attribute) and node.func.attr in YAML_DUMPS
                     and ast.unparse(node.func.value) in modules)
                    or (isinstance(node.func, ast.Name) and node.func.id in functions)):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def autouse_copies(root: Path) -> list[str]:
    """Autouse fixtures outside tests/conftest.py that touch the state the shared reset owns: ``path:line name``."""
    found = []
    for name, path, node, autouse in _fixtures(root):
        if autouse and path.relative_to(root) != Path(SHARED_RESET):
            body = ast.unparse(node)
            if any(needle in body for needle in SHARED_STATE):
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def issue_citations(root: Path) -> list[str]:
    """``path:line`` of every issue number cited in the ``.py`` files under ``root``."""
    return [f"{path.relative_to(root)}:{number}" for path in sorted(root.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(line)]


def test_code_and_tests_cite_no_issue_numbers() -> None:
    cited = [hit for folder in ("finetune", "tests", "scripts") for hit in issue_citations(REPO / folder)]
    assert not cited, f"say what the code or test is about, not which issue asked for it: {cited}"


# the one in-process stop of the resume tests (integration conftest's sigterm_after), and the 2-process runs' hook
STOPPERS = {"integration/conftest.py", "distributed/dist_hooks.py"}
SELF_SIGTERM = "os.kill(os.getpid(), " + "signal.SIGTERM)"  # split: this file is not a copy


def self_sigterms(root: Path) -> list[str]:
    """The test modules that send SIGTERM to their own process (a copy of the stop-then-resume helper)."""
    return sorted(str(path.relative_to(root)) for path in root.rglob("*.py")
                  if SELF_SIGTERM in path.read_text())


def test_one_stop_then_resume_helper() -> None:
    copies = set(self_sigterms(TESTS)) - STOPPERS
    assert not copies, f"use tests.integration.conftest's sigterm_after / run_stopped_after: {sorted(copies)}"


def test_no_two_fixtures_share_a_name() -> None:
    clashes = fixture_name_clashes(TESTS)
    assert not clashes, f"rename so each fixture name means one thing: {clashes}"


def test_only_the_one_writer_dumps_yaml() -> None:
    writers = yaml_writers(TESTS)
    assert not writers, f"write recipes with tests.recipe_files.write_recipe_file, not yaml.safe_dump: {writers}"


def test_no_autouse_fixture_copies_the_shared_reset() -> None:
    copies = autouse_copies(TESTS)
    assert not copies, f"tests/conftest.py's _fresh_process resets hooks, env and offline mode; use in_tmp: {copies}"


def test_the_shared_reset_is_autouse_in_the_top_conftest() -> None:
    autouse = [(name, path.relative_to(TESTS)) for name, path, _, auto in _fixtures(TESTS) if auto]
    assert ("_fresh_process", Path(SHARED_RESET)) in autouse


@pytest.mark.parametrize("check, source, flagged", [
    (fixture_name_clashes, "@pytest.fixture\ndef run(): ...\n", {"run"}),
    (yaml_writers, "import yaml\ndef w(p, r):\n    p.write_text(yaml.safe_dump(r))\n", {"a.py:3", "b.py:3"}),
    (yaml_writers, "from yaml import safe_dump as d\ndef w(p, r):\n    p.write_text(d(r))\n", {"a.py:3", "b.py:3"}),
    (autouse_copies, "@pytest.fixture(autouse=True)\ndef _x(monkeypatch):\n    monkeypatch.chdir('/')\n",
     {"a.py:2 _x", "b.py:2 _x"}),
    (autouse_copies, "@pytest.fixture(autouse=True)\ndef _x():\n    hooks.clear()\n", {"a.py:2 _x", "b.py:2 _x"}),
    (issue_citations, "x = 1\n# asked for by " + "Issue " + "12\n", {"a.py:2", "b.py:2"}),
    (self_sigterms, f"import os, signal\n{SELF_SIGTERM}\n", {"a.py", "b.py"}),
])
def test_each_check_flags_a_violation(tmp_path: Path, check: Callable[[Path], object], source: str,
                                      flagged: set[str]) -> None:
    """The checks above are not vacuous: the same offending source in two modules is reported."""
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(source)
    assert set(check(tmp_path)) == flagged  # type: ignore[call-overload]
