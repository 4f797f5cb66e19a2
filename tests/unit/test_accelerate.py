"""finetune.config.accelerate: the one reader of accelerate config files. One function opens and parses the file
(finetune.config.accelerate.read), reached through ``backends.accelerate_config`` by every command (validation, below
backends, calls the reader itself), so a missing, unreadable or invalid file is the same line through ``finetune
run``, ``plan`` and ``generate``; a process reads a file once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.cli_helpers import assert_user_error, main_exit
from tests.package_ast import called, functions, modules


def test_the_accelerate_config_file_is_read_in_one_function() -> None:
    """Only finetune.config.accelerate finds and parses an accelerate config; only backends.accelerate_config,
    validation (which sits below backends) and the list of a recipe's inputs (finetune.config.outputs, which only
    locates the file) call it; nothing else that names an accelerate config reads a file."""
    readers = {"safe_load", "load", "read_text", "read_bytes", "open"}
    finders = {"shipped_accelerate_config", "accelerate_config_path", "read_accelerate_config"}
    parsing, finding, callers = [], [], []
    for name, tree in modules():
        for function in functions(tree):
            names = {node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
                     for node in ast.walk(function) if isinstance(node, ast.Attribute | ast.Name)}
            calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)]
            here = f"{name}:{function.name}"
            if name == "accelerate.py":
                continue
            if "accelerate_config" in names and any(called(c) in readers and not _is_reader_call(c) for c in calls):
                parsing.append(here)
            if any(called(c) in finders for c in calls):
                finding.append(here)
            if any(_is_reader_call(c) for c in calls):
                callers.append(here)
    assert parsing == [], f"an accelerate config is read outside finetune.config.accelerate: {parsing}"
    assert finding == [], f"an accelerate config is found outside finetune.config.accelerate: {finding}"
    assert sorted(callers) == ["outputs.py:accelerate_file", "select.py:accelerate_config",
                               "validate.py:_semantic_lines"]


def _is_reader_call(call: ast.Call) -> bool:
    """``accelerate.load(...)`` / ``accelerate.read(...)`` / ``accelerate.locate(...)``: finetune.config.accelerate."""
    func = call.func
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "accelerate" \
        and func.attr in ("load", "read", "locate")


# --- one line through every command ---------------------------------------------------------------------------------

BROKEN = {
    "missing": None,
    "list": "- distributed_type: NO\n- 2\n",
    "not-yaml": "distributed_type: [NO\n",
    "binary": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_accelerate_config_is_the_same_line_through_run_plan_and_generate(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "acc.yaml"
    content = BROKEN[kind]
    if isinstance(content, bytes):
        config.write_bytes(content)
    elif content is not None:
        config.write_text(content)
    (tmp_path / "model").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n')
    commands = {  # the setting as each command spells it, and its command line
        "run": ("launch.accelerate_config", ["run", "quickstart"]),
        "dry-run": ("launch.accelerate_config", ["run", "quickstart", "--dry-run"]),
        "plan": ("launch.accelerate_config", ["plan", "quickstart"]),
        "generate": ("--accelerate-config", ["generate", "model", "prompts.jsonl", "-o", "out.jsonl"]),
    }
    bodies = {}
    for command, (key, argv) in commands.items():
        lines = assert_user_error(*main_exit(monkeypatch, capsys, *argv, "--accelerate-config", str(config)))
        assert len(lines) == 1, (command, lines)
        prefix = f"error: {key}: "
        assert lines[0].startswith(prefix), (command, lines[0])
        bodies[command] = lines[0].removeprefix(prefix)
    assert len(set(bodies.values())) == 1, bodies
    body = bodies["run"]
    assert (repr(str(config)) if kind == "missing" else str(config.resolve())) in body  # names the file
    assert "use a" in body or "shipped" in body  # and the fix
    assert not list(tmp_path.glob("runs")) and not (tmp_path / "out.jsonl").exists()


def test_a_process_reads_an_accelerate_config_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation, the one-machine check and the launch line all ask for the file: it is read once, and read again
    only when it changed."""
    from finetune.config import accelerate

    config = tmp_path / "mine.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    reads: list[Path] = []
    real = Path.read_text

    def counted(self: Path, *args: object, **kwargs: object) -> str:
        reads.append(self)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", counted)
    first = accelerate.load(str(config))
    first.settings["num_processes"] = 99  # a caller's change does not leak into the next read
    again = accelerate.load(str(config))
    assert reads.count(config.resolve()) == 1 and again.settings == {"distributed_type": "MULTI_GPU",
                                                                      "num_processes": 2}
    config.write_text("distributed_type: FSDP\n")
    assert accelerate.load(str(config)).settings == {"distributed_type": "FSDP"}
    assert reads.count(config.resolve()) == 2
