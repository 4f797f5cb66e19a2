"""finetune/data imports downward only: its modules form no circle, and none hides an import of another of our
modules inside a function unless that module imports torch, transformers or datasets at its top."""

from __future__ import annotations

import ast
from pathlib import Path

import finetune.data

DATA = Path(finetune.data.__file__).parent
PACKAGE = DATA.parents[0]
HEAVY = ("torch", "transformers", "datasets", "deepspeed")


def own_imports(tree: ast.Module) -> list[tuple[str, bool, int]]:
    """(module, inside a function, line) of each import of a finetune module; ``from finetune.data import x``
    names the submodule x when one exists."""
    found: list[tuple[str, bool, int]] = []
    inner = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
             for node in ast.walk(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune"):
            names = [f"{node.module}.{a.name}" for a in node.names
                     if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()]
            found += [(name, id(node) in inner, node.lineno) for name in names or [node.module]]
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in inner, node.lineno) for a in node.names if a.name.startswith("finetune")]
    return found


def module_file(name: str) -> Path:
    path = PACKAGE.parent / name.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def heavy_at_top(name: str) -> bool:
    """Whether module ``name`` imports a heavy third-party package at its top level."""
    tree = ast.parse(module_file(name).read_text())
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n.split(".")[0] in HEAVY for n in names):
            return True
    return False


def graph() -> dict[str, set[str]]:
    """finetune.data.<module> -> the finetune.data modules it imports (at the top or inside functions)."""
    edges: dict[str, set[str]] = {}
    for path in sorted(DATA.glob("*.py")):
        name = "finetune.data" if path.stem == "__init__" else f"finetune.data.{path.stem}"
        edges[name] = {target for target, _, _ in own_imports(ast.parse(path.read_text()))
                       if target.startswith("finetune.data") and target != name}
    return edges


def test_the_data_modules_import_each_other_without_a_circle() -> None:
    edges = graph()
    submodules = {name: targets - {"finetune.data"} for name, targets in edges.items() if name != "finetune.data"}
    assert not any("finetune.data" in targets for name, targets in edges.items() if name != "finetune.data"), \
        "a data module imports the package (which imports them)"
    done: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        assert name not in visiting, f"import circle: {' -> '.join([*visiting[visiting.index(name):], name])}"
        visiting.append(name)
        for target in sorted(submodules.get(name, ())):
            visit(target)
        visiting.pop()
        done.append(name)

    for name in sorted(submodules):
        visit(name)


def test_no_data_module_hides_a_light_import_of_our_own_inside_a_function() -> None:
    for path in sorted(DATA.glob("*.py")):
        for target, inner, line in own_imports(ast.parse(path.read_text())):
            if inner:
                assert heavy_at_top(target), (f"{path.name}:{line} imports {target} inside a function; it imports "
                                              "no torch/transformers/datasets, so import it at the top")
