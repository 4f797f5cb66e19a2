"""Every ``finetune`` command in the README's bash code blocks, run exactly as written, from folders that are not the
repository.

The blocks are parsed from README.md, so a command added there is run here (or fails this test until it is given what
it needs). A block or command that cannot run on a CPU-only machine in one process is skipped by name, with its
reason, in :data:`SKIPPED_BLOCKS` / :data:`SKIPPED_COMMANDS`; a line that is neither a ``finetune`` command nor
listed there fails the test, so nothing is left out silently, and a listed skip that the README no longer holds
fails it too.

The commands run through the real entry point in this process (:func:`finetune.cli.main`). Each block runs in a
fresh folder of its own holding what its commands name: ``recipes/`` (every shipped recipe made small: the
architecture's tiny default size, 2-row steps, a few data rows; ``recipes/quickstart.yaml`` trains 100 steps with a
checkpoint at step 100), ``recipe.yaml`` (a 2-step quickstart named ``mine``), ``my-vlm.yaml``, ``prompts.jsonl``, and
the runs ``runs/q``, ``runs/a``, ``runs/b``, ``runs/theirs``, ``runs/x``: copies of the one tiny run that the
Commands block's first command trains. ``FINETUNE_RECIPES_DIR`` points at the same small recipes (2 steps each), so
a recipe given by name (``finetune run quickstart``) is small too; the Commands block runs that one from an empty
folder ("from any folder"). A ``train.max_steps=N`` override is made small (:func:`fewer_steps`: the README's
``resume runs/q train.max_steps=400`` alone trained 300 tiny steps, 225 s). A shell redirect (``> file``) is done
here.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import REPO, cli_exit_code, small_recipes
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.integration

RUNS_COPIED = ("q", "a", "b", "theirs", "x")  # runs the README names that no command of its block trains

TWO_PROCESSES = ("2 processes: CI has no room for another 2-process launch; the backends and elastic resume run in "
                 "tests/distributed")
# The first line of a bash block -> why the whole block is not run here.
SKIPPED_BLOCKS = {
    "make quickstart": "make creates .venv (network) and runs the full-size quickstarts; tests/integration/"
                       "test_quickstarts.py runs the same recipes and checks their numbers",
    "python3 -m venv .venv && . .venv/bin/activate": "installs packages from the network; tests/integration/"
                                                     "test_wheel.py installs the built wheel offline",
    ".venv/bin/python scripts/bench_throughput.py --rounds 2 --out docs/bench-throughput.md":
        "a 5-minute benchmark script, not a finetune command",
    "TORCH_SPEC=torch make setup": "installs a CUDA torch from the network and runs the GPU check, which needs a GPU; "
                                   "tests/integration/test_gpu_check.py runs its CPU dry run",
    ".venv/bin/python scripts/bench_tokenize.py --rows 20000 --procs 1,2,all --rounds 3":
        "a benchmark script of several minutes, not a finetune command",
    "#!/bin/bash": "a SLURM job: needs a cluster of 2 nodes with 8 GPUs each",
}
# A command of a block that is otherwise run -> why it is not run here.
SKIPPED_COMMANDS = {
    "finetune resume runs/q --num-processes 2 --accelerate-config ddp": TWO_PROCESSES,
    "finetune resume runs/z3 --num-processes 1 --accelerate-config cpu": "needs a ZeRO-3 run of 2 processes; "
                                                                          "tests/distributed/test_elastic.py",
    "finetune run recipe.yaml --accelerate-config zero3 --num-processes 2": TWO_PROCESSES,
    "accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 -m finetune run recipe.yaml":
        TWO_PROCESSES,
    "finetune run my-vlm.yaml peft.method=lora peft.preset=attn_mlp --accelerate-config fsdp2 --num-processes 8":
        "8 processes (a GPU node)",
}


@dataclass
class Block:
    """One bash code block of the README: the section it is in, its first line and its commands (comments
    dropped, continued lines joined)."""

    section: str
    first_line: str
    commands: list[str]


def readme_blocks() -> list[Block]:
    """Every ```bash block of README.md, in order."""
    blocks, section = [], ""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        if lines[i].strip() == "```bash":
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            text = "\n".join(body).replace("\\\n", " ")
            first = re.sub(r"\s+#.*$", "", next(line.strip() for line in body if line.strip()))  # comment dropped
            commands = [" ".join(shlex.split(line, comments=True)) for line in text.splitlines()]
            blocks.append(Block(section, first, [c for c in commands if c]))
        i += 1
    return blocks


def _block_folder(folder: Path) -> Path:
    """A fresh folder for one block: small recipes, ``recipe.yaml``, ``my-vlm.yaml`` and ``prompts.jsonl``."""
    recipes = small_recipes(folder, {"quickstart": 100})  # `export runs/q --from step-000100`
    recipe = yaml.safe_load((recipes / "quickstart.yaml").read_text())
    recipe["name"] = "mine"
    recipe["data"].update(train="recipes/data/reverse_train.jsonl", eval="recipes/data/reverse_eval.jsonl")
    recipe["train"].update(global_batch_size=32, max_steps=2)  # the plan command asks for 8 processes
    recipe["checkpoint"]["every_steps"] = 2
    write_recipe_file(folder / "recipe.yaml", recipe)
    vlm = yaml.safe_load((recipes / "vlm-quickstart.yaml").read_text())
    vlm["name"] = "my-vlm"
    vlm["data"].update(train="recipes/data/shapes/train.jsonl", eval="recipes/data/shapes/eval.jsonl")
    write_recipe_file(folder / "my-vlm.yaml", vlm)
    (folder / "prompts.jsonl").write_text('{"instruction": "Reverse the letters.", "input": "a b c"}\n'
                                          '{"prompt": "x y"}\n')
    return folder


def fewer_steps(command: str) -> str:
    """``command`` with its ``train.max_steps=N`` made small (CI time; what the command does is the same): a resume
    goes 2 steps past the copied run's last checkpoint (step 100), a new run trains at most 4 steps."""
    def small(match: re.Match[str]) -> str:
        steps = int(match.group(1))
        return f"train.max_steps={min(steps, 102 if command.startswith('finetune resume ') else 4)}"

    return re.sub(r"\btrain\.max_steps=(\d+)", small, command)


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


def test_every_readme_bash_line_is_run_or_skipped_with_a_reason() -> None:
    """The skip lists name only what the README holds, and every other line of a block that runs is a finetune
    command: a new command cannot be left out without a reason written here."""
    blocks = readme_blocks()
    firsts = {block.first_line for block in blocks}
    commands = {command for block in blocks for command in block.commands}
    assert not set(SKIPPED_BLOCKS) - firsts, "a skipped block is no longer in the README"
    assert not set(SKIPPED_COMMANDS) - commands, "a skipped command is no longer in the README"
    for block in blocks:
        if block.first_line not in SKIPPED_BLOCKS:
            strays = [c for c in block.commands if not c.startswith("finetune ") and c not in SKIPPED_COMMANDS]
            assert not strays, f"README ({block.section}): not a finetune command, and no reason to skip it: {strays}"


def test_readme_commands_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FINETUNE_RECIPES_DIR", str(small_recipes(tmp_path / "shipped", {})))
    blocks = [b for b in readme_blocks() if b.first_line not in SKIPPED_BLOCKS]
    assert blocks[0].section == "Commands" and blocks[0].commands[0] == "finetune run recipes/quickstart.yaml", \
        "the first block that runs must start by training the quickstart (its run is copied for the others)"
    trained = tmp_path / "block-0" / "runs" / "quickstart"
    failed, timings = [], []
    for index, block in enumerate(blocks):
        work, elsewhere = _block_folder(tmp_path / f"block-{index}"), tmp_path / f"elsewhere-{index}"
        elsewhere.mkdir()
        for command in block.commands:
            if command in SKIPPED_COMMANDS:
                continue
            anywhere = block.section == "Commands" and command == "finetune run quickstart"  # "from any folder"
            monkeypatch.chdir(elsewhere if anywhere else work)
            if trained.is_dir():
                for name in RUNS_COPIED:
                    if re.search(rf"\bruns/{name}(/|\s|$)", command) and not (work / "runs" / name).exists():
                        shutil.copytree(trained, work / "runs" / name)
            start = time.perf_counter()
            code = _run(fewer_steps(command), capsys)
            timings.append(f"{time.perf_counter() - start:6.1f} s  {command}")
            if code != 0:
                failed.append(f"({block.section}) {command}: exit {code}: {capsys.readouterr().err.strip()[-500:]}")
    with capsys.disabled():
        print("\n" + "\n".join(timings))
    assert not failed, "\n".join(failed)
    first = tmp_path / "block-0"
    assert (first / "q-100" / "manifest.json").is_file()
    assert (first / "cmp.png").stat().st_size > 0
    assert (first / "out.jsonl").read_text().count("\n") == 2
    assert (first / "runs" / "try" / "final").is_dir() and (tmp_path / "elsewhere-0" / "runs" / "quickstart" /
                                                              "final").is_dir()
    assert '"properties"' in next(tmp_path.glob("block-*/recipe.schema.json")).read_text()
    # the README's LoRA quickstart: the adapter run of the shipped recipe, merged into a plain model
    merged = [p for p in tmp_path.glob("block-*/runs/*") if (p / "config.json").is_file()]
    assert merged and all(json.loads((p / "manifest.json").read_text()) for p in merged)
