"""The house as the map in docs/architecture.md draws it: folders by role, arrows only down, no circles, and
imports inside functions only where the module imported is heavy (it pulls torch, transformers, datasets, ... at
import time) and the line says so. Read from the source with ``ast``, so nothing here imports the package."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "finetune"

# Rank of each part of the package, top to bottom: an import may point to its own rank or lower, never higher.
RANKS = {
    "finetune.cli": 8, "finetune.__main__": 8,
    "finetune.commands": 7,
    "finetune.runtime": 6, "finetune.artifacts": 6,
    "finetune.tasks": 5, "finetune.backends": 5,
    "finetune.data": 4,
    "finetune.storage": 3,
    "finetune.config": 2,
    "finetune.registry": 1, "finetune.objectives": 1,
    "finetune.errors": 0, "finetune.hooks": 0, "finetune.quiet": 0, "finetune.version": 0, "finetune": 0,
}
# Third-party modules heavy enough to import only when a function needs them (the CLI imports none of them).
HEAVY = {"torch", "safetensors", "datasets", "accelerate", "transformers", "deepspeed", "peft", "matplotlib", "numpy",
         "rich", "PIL", "wandb", "huggingface_hub", "tensorboard", "liger_kernel", "flash_attn",
         "bitsandbytes", "torchvision", "mlflow", "trackio", "aim", "pandas", "pyarrow"}

SECONDS_TO_IMPORT = {"torch", "transformers", "datasets", "deepspeed", "accelerate", "peft", "matplotlib", "numpy"}
# Light modules imported late on purpose: finetune/__init__ runs before ``python -m finetune`` drops the current
# folder from sys.path, so quiet.py imports logging only once the path is safe.
DEFERRED = {("finetune.quiet", "logging")}
SAYS_WHY = ("imports ", "heavy", "lazy:")  # how a trailing comment on an import inside a function begins


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _rank(module: str) -> int:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in RANKS:
            return RANKS[".".join(parts[:i])]
    raise AssertionError(f"{module} is in no folder of the map: add it to RANKS and to docs/architecture.md's map")


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, and whether it runs when the module is imported (module level, or under a
    module-level if/try) rather than inside a function or class body."""
    top: set[int] = set()
    for node in tree.body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try, ast.Import, ast.ImportFrom)) else ():
            top.add(id(sub))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, id(node) in top


def _own(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        if node.level or not node.module or node.module.split(".")[0] != "finetune":
            return []
        return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names]
    return [a.name for a in node.names if a.name.split(".")[0] == "finetune"]


def _roots(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.ImportFrom):
        return {node.module.split(".")[0]} if node.module and not node.level else set()
    return {a.name.split(".")[0] for a in node.names}


def _type_checking_only(tree: ast.Module) -> set[int]:
    return {id(sub) for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in ast.walk(node)}


TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _edges(at_import_only: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        hidden = _type_checking_only(tree)
        for node, at_import in _imports(tree):
            if id(node) in hidden or (at_import_only and not at_import):
                continue
            edges[name] |= {t for t in _own(node) if t != name}
        if at_import_only:  # importing a.b.c runs a and a.b first
            parts = name.split(".")
            edges[name] |= {".".join(parts[:i]) for i in range(1, len(parts))}
    return edges


def _heavy_at_import(heavy_roots: frozenset[str] | set[str] = HEAVY) -> dict[str, str | None]:
    direct = {}
    for name, tree in TREES.items():
        hidden = _type_checking_only(tree)
        roots = set()
        for node, at_import in _imports(tree):
            if at_import and id(node) not in hidden:
                roots |= _roots(node) & heavy_roots
        direct[name] = min(roots) if roots else None
    edges = _edges(at_import_only=True)
    heavy: dict[str, str | None] = {}
    for start in MODULES:
        seen, todo, found = {start}, [start], None
        while todo and found is None:
            current = todo.pop()
            found = direct[current]
            for nxt in edges[current] - seen:
                seen.add(nxt)
                todo.append(nxt)
        heavy[start] = found
    return heavy


def test_every_module_sits_in_a_folder_of_the_map() -> None:
    for name in MODULES:
        _rank(name)


def test_arrows_only_point_down() -> None:
    up = [f"{name} -> {target}" for name, targets in _edges(at_import_only=False).items() for target in targets
          if _rank(target) > _rank(name)]
    assert not up, "imports that point up the map:\n" + "\n".join(sorted(up))


def test_no_circles() -> None:
    """No module reaches itself through our own imports, counting those inside functions (they close circles
    just the same, only later)."""
    edges = _edges(at_import_only=False)
    state: dict[str, int] = {}
    circles: list[str] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(edges[name]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[name] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_imports_inside_functions_are_heavy_and_say_so() -> None:
    heavy = _heavy_at_import()
    wrong = []
    for name, tree in TREES.items():
        lines = MODULES[name].read_text().splitlines()
        for node, at_import in _imports(tree):
            if at_import:
                continue
            where = f"{MODULES[name].relative_to(PACKAGE.parent)}:{node.lineno}"
            own = _own(node)
            if own:
                light = [t for t in own if not heavy[t]]
                if light:
                    wrong.append(f"{where}: {', '.join(light)} imports nothing heavy: import it at the top")
            elif not _roots(node) & HEAVY and (name, *_roots(node)) not in DEFERRED:
                wrong.append(f"{where}: {', '.join(sorted(_roots(node)))} is not heavy: import it at the top")
            said = (lines[node.lineno - 1] + lines[node.end_lineno - 1]).partition("#")[2].strip()
            if not said.startswith(SAYS_WHY):
                wrong.append(f"{where}: an import inside a function says why (`# imports torch`, `# heavy: ...`)")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", ["finetune.cli", "finetune.commands",
                                    *sorted(name for name in MODULES if name.startswith("finetune.storage"))])
def test_the_cli_side_imports_no_heavy_module(module: str) -> None:
    """What `finetune --help` imports pulls in none of the libraries that take seconds (tests/unit/test_cli.py
    checks the same in a real process), and neither does any storage module: the run directory is read without
    torch (``finetune ls``, the summary, the plot)."""
    assert _heavy_at_import(SECONDS_TO_IMPORT)[module] is None


BACKEND_NAMES = frozenset({"single", "ddp", "fsdp", "deepspeed", "fsdp1", "fsdp2", "zero1", "zero2", "zero3",
                           "zero1_offload", "zero2_offload", "zero3_offload"})
BACKEND_HOLDERS = ("backend", "sharding", "engine")  # names of what holds a backend (its .kind is a backend's kind)


def _backend_tests(tree: ast.AST) -> Iterator[ast.Compare]:
    """Comparisons that ask which backend this is: a backend object's ``.kind`` (``backend.kind``,
    ``config.backend.kind``, ``sharding.kind``), or a backend's name as a literal (``name == "ddp"``,
    ``x in ("single", "ddp")``). A ``kind`` of anything else (a tracking row's ``kind == "train"``) is not one."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = {c.value for side in sides for c in ast.walk(side)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        kinds = [side for side in sides if isinstance(side, ast.Attribute) and side.attr == "kind"
                 and any(holder in ast.unparse(side.value).lower() for holder in BACKEND_HOLDERS)]
        if kinds or literals & BACKEND_NAMES:
            yield node


def test_only_the_backends_ask_which_backend_runs() -> None:
    """Every decision that depends on the backend is the backend object's answer (finetune/backends): nowhere
    else does code compare a backend's kind or name."""
    asked = [f"{MODULES[name].relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
             for name, tree in TREES.items() if not name.startswith("finetune.backends")
             for node in _backend_tests(tree)]
    assert not asked, "ask the backend object instead:\n" + "\n".join(asked)


@pytest.mark.parametrize(("source", "flagged"), [
    ('if backend.kind == "fsdp": pass', True),
    ('if config.backend.kind != "deepspeed": pass', True),
    ('ok = sharding.kind in ("single", "ddp")', True),
    ('ok = name == "zero3_offload"', True),
    ('ok = backend.kind == other.kind', True),
    ('ok = row.kind == "train"', False),
    ('ok = kind == "train"', False),
    ('ok = backend.name', False),
    ('ok = written.kind == "adapter"', False),
])
def test_the_backend_check_flags_what_it_should(source: str, flagged: bool) -> None:
    assert bool(list(_backend_tests(ast.parse(source)))) is flagged


def _map_block(path: Path) -> list[list[str]]:
    """The parts each line of the map in ``path`` names (the ```finetune/ block): ``["cli.py", "__main__.py"]``,
    ``["commands/"]``, ... in the map's order, top to bottom."""
    text = path.read_text(encoding="utf-8")
    block = text[text.index("```\nfinetune/\n") + len("```\nfinetune/\n"):]
    block = block[:block.index("```")]
    rows = []
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            names = line.strip().split("  ")[0]
            rows.append([name.strip() for name in names.split(",")])
    return rows


def test_the_map_names_every_part_of_the_package_in_rank_order() -> None:
    """The map in docs/architecture.md (the one map: the README points there) matches the code: it names every
    folder and top-level module of the package, nothing else, top to bottom in the ranks this test file enforces."""
    rows = _map_block(PACKAGE.parent / "docs" / "architecture.md")
    named = [name for row in rows for name in row]
    actual = {f"{path.name}/" for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    actual |= {path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    assert sorted(named) == sorted(actual), "the map and the package differ"
    ranks = [_rank("finetune." + name.removesuffix("/").removesuffix(".py")) for name in named]
    assert ranks == sorted(ranks, reverse=True), f"the map's order is not the ranks' order: {named}"
