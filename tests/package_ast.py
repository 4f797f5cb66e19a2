"""The package's modules as syntax trees, for the unit tests that check by reading the source which module calls
what (tests/unit/test_row_and_accelerate_config.py, test_accelerate.py). Nothing is imported or run."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"


@functools.cache
def modules() -> list[tuple[str, ast.Module]]:
    """(file name, syntax tree) of every module of the package; by file name, not folder, so that moving modules
    into role folders keeps these checks as they are."""
    return [(path.name, ast.parse(path.read_text(encoding="utf-8"))) for path in sorted(PACKAGE.rglob("*.py"))]


def called(node: ast.Call) -> str:
    """The called name: ``get_model`` for ``get_model(...)`` and ``registry.get_model(...)``."""
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method defined anywhere in ``tree``."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
