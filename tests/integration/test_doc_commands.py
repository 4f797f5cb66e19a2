"""Every ``finetune`` command in the bash code blocks of README.md and of the docs pages (docs/**/*.md), run exactly
as written, from folders that are not the repository.

The blocks are parsed from the pages, so a command added there is run here (or fails this test until it is given
what it needs). A block or command that cannot run on a CPU-only machine in one process is skipped by name, with its
reason, in :data:`SKIPPED_BLOCKS` (by the block's first line, wherever it appears) / :data:`SKIPPED_COMMANDS`; a line
that is neither a ``finetune`` command nor listed there fails the test, so nothing is left out silently, and a listed
skip that no page holds any more fails it too.

One test per block that runs (its id: the page and its section). The commands run through the real entry point in
this process (:func:`finetune.cli.main`). Each block runs in a fresh folder of its own holding what its commands
name: ``recipes/`` (every shipped recipe made small: the architecture's tiny default size, 2-row steps, a few data
rows; ``recipes/quickstart.yaml`` trains 100 steps with a checkpoint at step 100), ``recipe.yaml`` (a 2-step
quickstart named ``mine``), ``my-vlm.yaml``, ``prompts.jsonl``, and the runs ``runs/q``, ``runs/a``, ``runs/b``,
``runs/theirs``, ``runs/x``: copies of the one tiny run that :data:`TRAINS` (the first command of the Quickstart
page's Commands block) trains, once per module, in a folder made the same way (:func:`quickstart_run`; that block
gets a copy in its place). ``FINETUNE_RECIPES_DIR`` points at the same small recipes (2 steps each), so a recipe
given by name (``finetune run quickstart``) is small too; the Commands block runs that one from an empty folder
("from any folder"). A ``train.max_steps=N`` override is made small (:func:`fewer_steps`: the docs'
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import REPO, cli_exit_code, small_recipes
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.integration

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
TRAINS = "finetune run recipes/quickstart.yaml"  # the run the other blocks copy (trained once, by quickstart_run)
ANYWHERE = "finetune run quickstart"  # in TRAINS's block: "a shipped recipe by name, from any folder"
RUNS_COPIED = ("q", "a", "b", "theirs", "x")  # runs the docs name that no command of their block trains

TWO_PROCESSES = ("2 processes: CI has no room for another 2-process launch; the backends and elastic resume run in "
                 "tests/distributed")
HUB_MODEL = ("Qwen/Qwen2.5-0.5B-Instruct is a hub model: downloading it needs the network, which tests do not have "
             "(the same verbs run on the tiny quickstart model in the Quickstart page's Commands block)")
# The first line of a bash block -> why the whole block is not run here (a block of that first line is skipped on
# every page that holds it: README.md and a docs page may show the same one).
SKIPPED_BLOCKS = {
    "make quickstart": "make creates .venv (network) and runs the full-size quickstarts; tests/integration/"
                       "test_quickstarts.py runs the same recipes and checks their numbers",
    "make quickstart-minilm": "make creates .venv (network) and runs the full-size quickstart; tests/integration/"
                              "test_quickstarts.py runs the same recipe and checks its numbers",
    "make setup": "creates .venv and installs packages from the network (in docs/parity-trl.md it is followed by "
                  "scripts/parity_trl.py, which tests/integration/test_parity_trl.py runs in make test-all)",
    "make test": "the test suite itself",
    "python3 -m venv .venv && . .venv/bin/activate": "installs packages from the network; tests/integration/"
                                                     "test_wheel.py installs the built wheel offline",
    "finetune plan my-qwen.yaml": HUB_MODEL,
    ".venv/bin/python scripts/bench_throughput.py --rounds 2 --out docs/bench-throughput.md":
        "a 5-minute benchmark script, not a finetune command",
    "TORCH_SPEC=torch make setup": "installs a CUDA torch from the network and runs the GPU check, which needs a GPU; "
                                   "tests/integration/test_gpu_check.py runs its CPU dry run",
    ".venv/bin/python scripts/bench_tokenize.py --rows 20000 --procs 1,2,all --rounds 3":
        "a benchmark script of several minutes, not a finetune command",
    "#!/bin/bash": "a SLURM job: needs a cluster of 2 nodes with 8 GPUs each",
    "python scripts/measure_load_rss.py --wait 1800": "a measurement script of 2-process loads, not a finetune "
                                                      "command; tests/distributed/test_load_once.py checks the loading",
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


def _merged(folder: Path) -> bool:
    return (folder / "config.json").is_file() and bool(json.loads((folder / "manifest.json").read_text()))


# What a command leaves in its block's folder, besides exit 0: checked after its block ran.
WRITES: dict[str, Callable[[Path], bool]] = {
    "finetune run recipes/quickstart.yaml train.max_steps=50 -o runs/try": lambda w: (w / "runs/try/final").is_dir(),
    "finetune export runs/q --from step-000100 -o q-100": lambda w: (w / "q-100" / "manifest.json").is_file(),
    "finetune plot runs/a runs/b -o cmp.png": lambda w: (w / "cmp.png").stat().st_size > 0,
    "finetune generate runs/x prompts.jsonl -o out.jsonl": lambda w: (w / "out.jsonl").read_text().count("\n") == 2,
    "finetune schema > recipe.schema.json": lambda w: '"properties"' in (w / "recipe.schema.json").read_text(),
    # the LoRA quickstart: the adapter run of the shipped recipe, merged into a plain model
    "finetune merge runs/lora-quickstart -o runs/lora-merged": lambda w: _merged(w / "runs" / "lora-merged"),
}


@dataclass
class Block:
    """One bash code block of a page: the page (relative to the repository), the section it is in, its first line
    and its commands (comments dropped, continued lines joined)."""

    page: str
    section: str
    first_line: str
    commands: list[str]

    @property
    def name(self) -> str:
        return f"{self.page}:{self.section}"


def page_blocks(page: Path) -> list[Block]:
    """Every ```bash block of ``page``, in order."""
    blocks, section = [], ""
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if re.match(r"#{1,3} ", lines[i]):
            section = lines[i].lstrip("#").strip()
        elif lines[i].startswith("```") and lines[i].strip() != "```bash":  # another fence: its lines are not headings
            i += 1
            while not lines[i].startswith("```"):
                i += 1
        elif lines[i].strip() == "```bash":
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            text = "\n".join(body).replace("\\\n", " ")
            first = re.sub(r"\s+#.*$", "", next(line.strip() for line in body if line.strip()))  # comment dropped
            commands = [" ".join(shlex.split(line, comments=True)) for line in text.splitlines()]
            blocks.append(Block(str(page.relative_to(REPO)), section, first, [c for c in commands if c]))
        i += 1
    return blocks


def doc_blocks() -> list[Block]:
    """Every ```bash block of README.md and the docs pages, page by page."""
    return [block for page in PAGES for block in page_blocks(page)]


def runnable_blocks() -> list[Block]:
    """The blocks this module runs: every block whose first line is not skipped."""
    return [block for block in doc_blocks() if block.first_line not in SKIPPED_BLOCKS]


def _ids(blocks: list[Block]) -> list[str]:
    names = [block.name for block in blocks]
    return [name if names.count(name) == 1 else f"{name}-{names[:i].count(name)}" for i, name in enumerate(names)]


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


def test_every_doc_bash_line_is_run_or_skipped_with_a_reason() -> None:
    """The skip lists name only what the pages hold, every other line of a block that runs is a finetune command
    (a new command cannot be left out without a reason written here), every command :data:`WRITES` checks is in a
    block that runs, and exactly one block that runs starts by training :data:`TRAINS`."""
    blocks = doc_blocks()
    firsts = {block.first_line for block in blocks}
    commands = {command for block in blocks for command in block.commands}
    assert not set(SKIPPED_BLOCKS) - firsts, "a skipped block is no longer in the docs"
    assert not set(SKIPPED_COMMANDS) - commands, "a skipped command is no longer in the docs"
    for block in blocks:
        if block.first_line not in SKIPPED_BLOCKS:
            strays = [c for c in block.commands if not c.startswith("finetune ") and c not in SKIPPED_COMMANDS]
            assert not strays, f"{block.name}: not a finetune command, and no reason to skip it: {strays}"
    run = {command for block in runnable_blocks() for command in block.commands}
    assert not set(WRITES) - run, "a command whose output is checked is no longer in a block that runs"
    assert [block.commands[0] for block in runnable_blocks()].count(TRAINS) == 1, \
        f"exactly one block that runs must start with {TRAINS!r} (its run is copied for the others)"


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:data:`TRAINS`, run once per module in a block folder of its own: the run the blocks copy."""
    folder = _block_folder(tmp_path_factory.mktemp("trained"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FINETUNE_RECIPES_DIR", str(folder / "recipes"))
        patch.chdir(folder)
        assert cli_exit_code(*shlex.split(TRAINS)[1:]) == 0, f"{TRAINS} failed"
    return folder / "runs" / "quickstart"


def _needs_the_run(block: Block) -> bool:
    return block.commands[0] == TRAINS or any(
        re.search(rf"\bruns/{name}(/|\s|$)", command) for command in block.commands for name in RUNS_COPIED)


@pytest.mark.parametrize("block", runnable_blocks(), ids=_ids(runnable_blocks()))
def test_doc_commands_run_as_written(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    trained = request.getfixturevalue("quickstart_run") if _needs_the_run(block) else None
    monkeypatch.setenv("FINETUNE_RECIPES_DIR", str(small_recipes(tmp_path / "shipped", {})))
    work, elsewhere = _block_folder(tmp_path / "block"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    source = block.commands[0] == TRAINS
    failed, timings = [], []
    for command in block.commands:
        if command in SKIPPED_COMMANDS:
            continue
        if source and command == TRAINS:  # it ran once, in quickstart_run: this block gets its run
            shutil.copytree(trained, work / "runs" / "quickstart")
            continue
        anywhere = source and command == ANYWHERE
        monkeypatch.chdir(elsewhere if anywhere else work)
        if trained is not None:
            for name in RUNS_COPIED:
                if re.search(rf"\bruns/{name}(/|\s|$)", command) and not (work / "runs" / name).exists():
                    shutil.copytree(trained, work / "runs" / name)
        start = time.perf_counter()
        code = _run(fewer_steps(command), capsys)
        timings.append(f"{time.perf_counter() - start:6.1f} s  {command}")
        if code != 0:
            failed.append(f"{command}: exit {code}: {capsys.readouterr().err.strip()[-500:]}")
        elif command in WRITES and not WRITES[command](work):
            failed.append(f"{command}: exit 0, but it did not write what it says")
    with capsys.disabled():
        print(f"\n{block.name}\n" + "\n".join(timings))
    assert not failed, f"{block.name}:\n" + "\n".join(failed)
    if source:
        assert (elsewhere / "runs" / "quickstart" / "final").is_dir(), f"{ANYWHERE} did not train from {elsewhere}"
