"""A run's recipe naming ``model.plugin`` imports nothing unless the command line says ``--trust-remote-code``.

Importing a plugin runs its code. ``finetune run RECIPE`` imports the plugin of the recipe the user named; every
command that reads a recipe stored in a run (eval of a run, a checkpoint or an export; export; merge; generate;
resume) and every process such a command starts (the export check's ``finetune.artifacts.reload``, the ranks of a
launched resume or generate) imports it only with the permission given on this command line, passed on explicitly.
Without it the command is refused in one line (exit 2) that names the module, the run's recipe file and the fix, before
the module is imported and before anything is written. With it, a plugin that calls ``sys.exit`` as it is imported
(even ``sys.exit(0)``) fails the command in one line naming it; it never ends finetune as if finetune had finished.

The plugin planted here writes a marker file when it is imported; it lies in a folder on ``sys.path`` and
PYTHONPATH, as an installed module would. The run is a 2-step LoRA tiny-llama run (a checkpoint after each step),
so that merge has an adapter to merge.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import DATA, trained_run

pytestmark = pytest.mark.integration

PLUGIN = "finetune_trust_probe_plugin"  # a name no installed package has
LORA = {"method": "lora", "preset": "attn_mlp", "r": 4, "alpha": 8}


@dataclass
class Planted:
    """The trained run, the folder the plugin lies in, the marker its import writes, and a prompts file."""

    run: Path
    plugins: Path
    marker: Path
    prompts: Path


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Planted]:
    root = tmp_path_factory.mktemp("trust")
    plugins, marker = root / "plugins", root / "IMPORTED"
    plugins.mkdir()
    (plugins / f"{PLUGIN}.py").write_text(f"from pathlib import Path\n\nPath({str(marker)!r}).write_text('imported')\n")
    (root / "eval.jsonl").write_text("".join((DATA / "reverse_eval.jsonl").read_text().splitlines(True)[:8]))
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    sys.path.insert(0, str(plugins))
    try:  # `finetune run` imports the plugin of the recipe it is given
        run = trained_run(root, "run", model={"type": "tiny-llama", "plugin": PLUGIN}, peft=LORA,
                          train={"max_steps": 2}, data={"eval": str(root / "eval.jsonl")},
                          eval={"metrics": ["token_accuracy"], "batch_size": 8}, checkpoint={"every_steps": 1})
        assert marker.is_file()
    finally:
        sys.path.remove(str(plugins))
        sys.modules.pop(PLUGIN, None)
    marker.unlink()
    yield Planted(run, plugins, marker, prompts)


@pytest.fixture
def fresh(planted: Planted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Planted, Path]]:
    """A copy of the run in ``tmp_path/run`` (what a command may change), the plugin importable here and in child
    processes, not yet imported, and no marker."""
    run = tmp_path / "run"
    shutil.copytree(planted.run, run)
    monkeypatch.syspath_prepend(str(planted.plugins))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(planted.plugins),
                                                                    os.environ.get("PYTHONPATH")))))
    sys.modules.pop(PLUGIN, None)
    planted.marker.unlink(missing_ok=True)
    yield Planted(run, planted.plugins, planted.marker, planted.prompts), tmp_path
    sys.modules.pop(PLUGIN, None)
    planted.marker.unlink(missing_ok=True)


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path) -> sha256 of its bytes (folders as "dir"): what a refused
    command must leave as it was. The run's lock file only says who holds it (merge and resume take the lock before
    they read the run): its presence counts, not its text."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else "lock" if p.name == "finetune.lock"
            else hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


# every command that reads a run's stored recipe: its arguments (run copy, scratch folder, prompts file)
COMMANDS: dict[str, Callable[[Path, Path, Path], list[str]]] = {
    "eval-run": lambda run, out, prompts: ["eval", str(run), "--json"],
    "eval-checkpoint": lambda run, out, prompts: ["eval", str(run / "checkpoints" / "step-000001"), "--json"],
    "eval-export": lambda run, out, prompts: ["eval", str(run / "final"), "--json"],
    "export": lambda run, out, prompts: ["export", str(run), "--from", "step-000001", "-o", str(out / "export")],
    "merge": lambda run, out, prompts: ["merge", str(run), "-o", str(out / "merged")],
    "generate": lambda run, out, prompts: ["generate", str(run), str(prompts), "-o", str(out / "gen.jsonl"),
                                           "--max-new-tokens", "2"],
    "resume": lambda run, out, prompts: ["resume", str(run), "--from", "step-000001"],
}


def refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], planted: Planted, root: Path,
            args: list[str]) -> None:
    """``finetune ARGS`` exits 2 with one line naming the plugin, the run's recipe file and --trust-remote-code;
    the plugin was not imported and no file under ``root`` changed."""
    before = tree(root)
    lines = assert_user_error(*main_exit(monkeypatch, capsys, *args), PLUGIN, "--trust-remote-code",
                              "recipe.resolved.yaml")
    assert len(lines) == 1, lines
    assert not planted.marker.exists() and PLUGIN not in sys.modules
    assert tree(root) == before


@pytest.mark.parametrize("command", COMMANDS)
def test_a_runs_plugin_is_imported_only_with_trust_remote_code(
        fresh: tuple[Planted, Path], command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    planted, root = fresh
    args = COMMANDS[command](planted.run, root, planted.prompts)
    refused(monkeypatch, capsys, planted, root, args)
    code, _, err = main_exit(monkeypatch, capsys, *args, "--trust-remote-code")
    assert code == 0, err
    assert planted.marker.is_file()


@pytest.mark.parametrize("command", ["resume", "generate"])
def test_launched_ranks_get_the_permission_from_the_command_line(
        fresh: tuple[Planted, Path], command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """With 2 processes, resume and generate exec ``accelerate launch``: without the flag they are refused before
    it; with it, the ranks' command line carries the permission (the worker's --allow-plugin, generate's
    --trust-remote-code). The exec is caught here: no second process starts."""
    planted, root = fresh
    args = [*COMMANDS[command](planted.run, root, planted.prompts), "--num-processes", "2", "--accelerate-config",
            "ddp"]
    launched: list[list[str]] = []
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: launched.append(list(argv)))
    refused(monkeypatch, capsys, planted, root, args)
    assert launched == []
    code, _, err = main_exit(monkeypatch, capsys, *args, "--trust-remote-code")
    assert code == 0, err
    module = {"resume": "finetune.runtime.worker", "generate": "finetune.commands.generate"}[command]
    permission = {"resume": "--allow-plugin", "generate": "--trust-remote-code"}[command]
    (argv,) = launched
    assert argv[argv.index("-m", argv.index("finetune.runtime.launcher")) + 1] == module
    assert permission in argv


def test_run_passes_the_permission_to_its_ranks(fresh: tuple[Planted, Path], monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``finetune run RECIPE`` names the recipe itself: its ranks may import the plugin, and are told so."""
    planted, root = fresh
    recipe = root / "again.yaml"
    shutil.copy(planted.run / "recipe.resolved.yaml", recipe)
    launched: list[list[str]] = []
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: launched.append(list(argv)))
    code, _, err = main_exit(monkeypatch, capsys, "run", str(recipe), "-o", str(root / "again"),
                             "--num-processes", "2", "--accelerate-config", "ddp")
    assert code == 0, err
    (argv,) = launched
    assert argv[-3:] == ["finetune.runtime.worker", str(root / "again" / "recipe.resolved.yaml"), "--allow-plugin"]


CHILDREN: dict[str, Callable[[Path, Path, Path], tuple[str, list[str]]]] = {
    # the module a command starts, and its arguments as the command passes them, without the permission
    "worker": lambda run, root, prompts: ("finetune.runtime.worker", [str(run / "recipe.resolved.yaml")]),
    "reload": lambda run, root, prompts: ("finetune.artifacts.reload", [
        str(run / "final"), "--inputs", str(root / "in.safetensors"), "--output", str(root / "out.safetensors"),
        "--mixed-precision", "no"]),
    "generate": lambda run, root, prompts: ("finetune.commands.generate", [
        str(run), str(prompts), "-o", str(root / "gen.jsonl"), "--max-new-tokens", "2",
        "--temperature", "0.0", "--top-p", "1.0", "--seed", "0", "--batch-size", "1"]),
}


@pytest.mark.parametrize("child", CHILDREN)
def test_a_child_process_without_the_permission_refuses(fresh: tuple[Planted, Path], child: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The processes finetune starts read the run's recipe again: without the permission on their own command line
    they refuse too (they never infer it from the run's files)."""
    import importlib

    planted, root = fresh
    module, args = CHILDREN[child](planted.run, root, planted.prompts)
    before = tree(root)
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and PLUGIN in lines[0] and "--trust-remote-code" in lines[0], err
    assert not planted.marker.exists()
    assert tree(root) == before


def test_a_recipe_named_on_the_command_line_imports_its_plugin(fresh: tuple[Planted, Path]) -> None:
    """The validator's one switch: a recipe the user names imports its plugin; a run's file only when allowed."""
    from finetune.config import compose, validate
    from finetune.config.validate import load_resolved
    from finetune.errors import ConfigError

    planted, _ = fresh
    resolved = planted.run / "recipe.resolved.yaml"
    with pytest.raises(ConfigError, match=PLUGIN):
        load_resolved(resolved)
    assert not planted.marker.exists()
    assert load_resolved(resolved, allow_plugin=True).model.plugin == PLUGIN
    assert planted.marker.is_file()
    planted.marker.unlink()
    sys.modules.pop(PLUGIN, None)
    cfg: Any = validate(compose(resolved))  # `finetune run runs/x/recipe.resolved.yaml`: the user named it
    assert cfg.model.plugin == PLUGIN and planted.marker.is_file()


@pytest.mark.parametrize("command", [*COMMANDS, "run"])
def test_a_plugin_that_exits_on_import_is_one_line(fresh: tuple[Planted, Path], command: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The module the run's recipe names, found first on the path, calls sys.exit(0): every command that imports
    it exits 2 with one line naming it (and ``finetune run`` leaves no run folder), writing nothing."""
    planted, root = fresh
    shadow = root / "shadow"
    shadow.mkdir()
    (shadow / f"{PLUGIN}.py").write_text("import sys\n\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(shadow))
    if command == "run":
        recipe = root / "again.yaml"
        shutil.copy(planted.run / "recipe.resolved.yaml", recipe)
        args = ["run", str(recipe), "-o", str(root / "again")]
    else:
        args = [*COMMANDS[command](planted.run, root, planted.prompts), "--trust-remote-code"]
    before = tree(root)
    lines = assert_user_error(*main_exit(monkeypatch, capsys, *args), PLUGIN, "called sys.exit(0)")
    assert len(lines) == 1, lines
    assert tree(root) == before
