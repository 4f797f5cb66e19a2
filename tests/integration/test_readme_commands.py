"""Every command of the README's Commands block, run exactly as written, from a folder that is not the repository.

The block is parsed from README.md, so a command added there is run here (or fails this test until it is given
what it needs). The commands run through the real entry point in this process (:func:`finetune.cli.main`) with the
current folder set to a temporary one holding what the commands name: ``recipes/quickstart.yaml`` (the quickstart
made small: tiny-llama, 100 steps of 2 rows, a checkpoint at step 100), ``recipe.yaml``, ``prompts.jsonl`` and the
runs ``runs/q``, ``runs/a``, ``runs/b``, ``runs/theirs``, ``runs/x`` (copies of the ``runs/quickstart`` the first
command trains). ``finetune run quickstart`` (a shipped recipe by name, from any folder) runs in a second, empty
folder with ``FINETUNE_RECIPES_DIR`` pointing at a 2-step quickstart. A shell redirect (``> file``) is done here.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import DATA, REPO, cli_exit_code

pytestmark = pytest.mark.integration

RUNS_COPIED = ("q", "a", "b", "theirs", "x")  # runs the block names that the block itself does not train


def readme_commands() -> list[str]:
    """The commands of the README's ``## Commands`` block, comments dropped, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Commands\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [" ".join(shlex.split(line, comments=True)) for line in block.splitlines() if line.strip()]


def _small_recipes(folder: Path, steps: int) -> Path:
    """``folder/recipes``: the shipped quickstart made small (same keys, ``steps`` steps of 2 rows, a checkpoint at
    the last), its data cut to a few rows."""
    recipes = folder / "recipes"
    (recipes / "data").mkdir(parents=True)
    for name, rows in (("reverse_train.jsonl", 64), ("reverse_eval.jsonl", 8)):
        lines = (DATA / name).read_text().splitlines()[:rows]
        (recipes / "data" / name).write_text("\n".join(lines) + "\n")
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    recipe["model"]["config_overrides"] = {}
    recipe["train"].update(micro_batch_size=2, global_batch_size=2, max_steps=steps)
    recipe["eval"].update(every_steps=None, at_start=False, max_new_tokens=4, batch_size=8)
    recipe["checkpoint"].update(every_steps=steps)
    recipe["logging"]["every_steps"] = 50
    (recipes / "quickstart.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return recipes


def _run(command: str, capsys: pytest.CaptureFixture[str]) -> int:
    """``command`` (``finetune ARGS [> FILE]``) through the real entry point; the exit code."""
    words = shlex.split(command)
    assert words[0] == "finetune", command
    args, redirect = words[1:], None
    if ">" in args:
        args, redirect = args[:args.index(">")], args[args.index(">") + 1]
    capsys.readouterr()
    if redirect is None:
        return cli_exit_code(*args)
    with open(redirect, "w", encoding="utf-8") as sink, contextlib.redirect_stdout(sink):
        return cli_exit_code(*args)


def test_readme_commands_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    recipes = _small_recipes(work, 100)  # `export runs/q --from step-000100`
    monkeypatch.setenv("FINETUNE_RECIPES_DIR", str(_small_recipes(tmp_path / "shipped", 2)))
    recipe = yaml.safe_load((recipes / "quickstart.yaml").read_text())
    recipe["data"].update(train="recipes/data/reverse_train.jsonl", eval="recipes/data/reverse_eval.jsonl")
    recipe["train"]["global_batch_size"] = 32  # the plan command asks for 8 processes
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    (work / "prompts.jsonl").write_text('{"instruction": "Reverse the letters.", "input": "a b c"}\n'
                                        '{"prompt": "x y"}\n')
    commands = readme_commands()
    assert commands[0] == "finetune run recipes/quickstart.yaml", "the block must start by training the quickstart"
    failed = []
    for command in commands:
        monkeypatch.chdir(elsewhere if command == "finetune run quickstart" else work)
        if command != commands[0]:
            for name in RUNS_COPIED:
                if not (work / "runs" / name).exists():
                    shutil.copytree(work / "runs" / "quickstart", work / "runs" / name)
        code = _run(command, capsys)
        if code != 0:
            failed.append(f"{command}: exit {code}: {capsys.readouterr().err.strip()[-500:]}")
    assert not failed, "\n".join(failed)
    assert (work / "q-100" / "manifest.json").is_file()
    assert (work / "cmp.png").stat().st_size > 0
    assert (work / "out.jsonl").read_text().count("\n") == 2
    assert '"properties"' in (work / "recipe.schema.json").read_text()
    assert (work / "runs" / "try" / "final").is_dir() and (elsewhere / "runs" / "quickstart" / "final").is_dir()
