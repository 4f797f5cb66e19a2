"""Shared fixtures: the one reset every test starts from, and small, valid recipes (with their data files) in a
temporary folder."""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from finetune import hooks
from tests.recipe_files import write_recipe_file


def share_the_cores() -> None:
    """Under pytest-xdist, give each worker its share of the cores for torch's intra-op threads, and to the processes
    its tests start (``OMP_NUM_THREADS``, which they inherit; ``accelerate launch`` reads it too). Why: ``make test``
    runs 2 workers on CI's 2 cores, and a torch process's pool has one thread per core by default, so the workers
    (and the processes they start) oversubscribe the cores and OpenMP threads spin against each other. Measured on
    the 2-core machine: test_train.py's golden-loss and accumulation tests took 57 s of CPU with 2 threads and 24 s
    with 1 (wall 96-130 s against 42-47 s). A value the shell set is kept; one process (no xdist) is left alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 1:
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
    if "torch" in sys.modules:  # imported before this file (a plugin): it read the variable already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


share_the_cores()


def answer_ctrl_c() -> None:
    """Let Ctrl+C reach the tests that send one, however the suite was started. A shell without job control starts a
    background command (``make test &``, nohup, some CI runners) with SIGINT ignored, every process below inherits
    that, and Python then installs no KeyboardInterrupt handler: the tests of finetune's Ctrl+C handling (a stop
    line and exit 130; a Ctrl+C after an export is published) would see nothing arrive. Seen here: the suite run in
    the background failed exactly those tests (SIGINT was SIG_IGN in the worker) and passed in the foreground. The
    processes the tests start then get SIGINT's default too (an ignored signal stays ignored across exec)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


answer_ctrl_c()


def pytest_configure(config: pytest.Config) -> None:
    """Under ``--dist loadfile`` xdist hands out files in the order :func:`pytest_collection_modifyitems` leaves
    them, not sorted by how many tests each holds (its default), which put the slowest files last: in the measured
    14-minute unit + integration run the quickstarts (2 tests, 148 s) and the README commands (1 test, 64 s; now
    test_doc_commands.py) ran at the end on one worker while the other sat idle for 77 s."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Whole files in the order that balances two xdist workers best without measured times: 2-process files first
    (``make test`` runs them in the same session as the rest; each of their tests launches 2 processes, and
    test_backends.py alone is the longest file, about 13 minutes of a worker), then files with a test marked
    ``slow``, then integration files before unit files, then more tests before fewer (the longest jobs first, the
    many short unit files fill the end). A file's own tests keep their order; the
    order is the same on every worker (xdist requires it)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(name: str) -> tuple[bool, bool, bool, int]:
        tests = files[name]
        return (name.startswith("tests/distributed/"), any(t.get_closest_marker("slow") for t in tests),
                not name.startswith("tests/unit/"), len(tests))

    items[:] = [item for name in sorted(files, key=weight, reverse=True) for item in files[name]]

# Variables a test must not inherit from the shell or an earlier test: a launcher's (a test is one process unless it
# launches more itself), debug tracebacks (they change what an error prints), a replacement recipes folder and the
# derived rows a command has said its line for (finetune.config.families: said once per command).
UNSET_FOR_TESTS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_LAUNCHED", "LOCAL_WORLD_SIZE", "FINETUNE_DEBUG",
                   "FINETUNE_RECIPES_DIR", "FINETUNE_DERIVED_SAID")

ALPACA_ROWS = [{"instruction": "Reverse the letters.", "input": "a b c", "output": "c b a"}] * 4

# The smallest recipe that validates: tiny-llama (no download), one alpaca file next to the recipe.
MINIMAL_RECIPE = {
    "name": "tiny",
    "model": {"type": "tiny-llama"},
    "data": {"format": "alpaca", "train": "train.jsonl"},
    "train": {"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 4},
}


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts from the same process state, whatever the shell or the previous test left: no test hooks
    registered (a callback a test registered never fires in the next one), none of ``UNSET_FOR_TESTS`` set, and the
    hub offline (this machine has no network; a launched worker inherits it). The only autouse reset of shared state
    (tests/unit/test_test_hygiene.py keeps it so); it costs a few dict operations per test."""
    for key in UNSET_FOR_TESTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hooks.clear()
    yield
    hooks.clear()


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test runs with its ``tmp_path`` as the current folder (relative paths, overrides and default outputs
    resolve there, never in the checkout); a module asks for it with ``pytest.mark.usefixtures("in_tmp")``."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def minimal_recipe() -> dict:
    """A fresh copy of the smallest valid recipe (as a dict) that ``write_recipe`` writes by default."""
    return copy.deepcopy(MINIMAL_RECIPE)


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """``write_recipe(text_or_dict=MINIMAL_RECIPE, name="recipe.yaml", folder=tmp_path)`` -> the recipe's path.

    A dict is dumped as block YAML (one key per line); a string is written verbatim. ``train.jsonl`` and
    ``eval.jsonl`` (alpaca rows) are created in the folder so relative data paths resolve.
    """

    def write(content: str | dict | None = None, name: str = "recipe.yaml", folder: Path | None = None) -> Path:
        folder = folder or tmp_path
        folder.mkdir(parents=True, exist_ok=True)
        for split in ("train", "eval"):
            data = folder / f"{split}.jsonl"
            if not data.exists():
                data.write_text("".join(json.dumps(row) + "\n" for row in ALPACA_ROWS))
        content = MINIMAL_RECIPE if content is None else content
        if isinstance(content, dict):
            return write_recipe_file(folder / name, content)
        path = folder / name
        path.write_text(content)
        return path

    return write
