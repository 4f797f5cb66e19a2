"""``finetune preprocess RECIPE`` tokenizes every split into the cache that ``finetune run`` then reads.

The first call says each source was tokenized now, the second that it was read from the cache; after it, the
inputs a run reads (``prepare.inputs``) tokenize nothing. A data file rewritten in between is tokenized again.

A command stopped while its workers tokenize (SIGKILL, SIGTERM to it or to its process group, Ctrl+C) leaves no
process behind and nothing that blocks the next preprocess: the real command runs in a subprocess, stopped while a
test hook holds one worker in its first row (tests/integration/kill_hooks.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune import hooks
from finetune.cli import app
from finetune.config import load_recipe
from finetune.registry import recipe_row
from finetune.runtime import prepare

REPO = Path(__file__).resolve().parents[2]
CHATS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
         for i in range(200)]
TERMINATED = "terminated (SIGTERM) while the data was read and tokenized; nothing half-written was published"
PROMPTS = [{"prompt": f"Reverse: {i} {i + 1}\n", "answer": f"{i + 1} {i}"} for i in range(20)]


def preprocess(recipe: Path) -> list[str]:
    result = CliRunner().invoke(app, ["preprocess", str(recipe)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [line for line in result.stdout.splitlines() if line.startswith("data.")]


def test_preprocess_fills_the_cache_that_a_run_reads(write_recipe: Callable[..., Path], minimal_recipe: dict,
                                                     tmp_path: Path) -> None:
    minimal_recipe["data"]["eval"] = "eval.jsonl"
    recipe = write_recipe(minimal_recipe)
    assert preprocess(recipe) == [f"data.train {tmp_path}/train.jsonl: 4 samples, tokenized now (cached)",
                                  f"data.eval {tmp_path}/eval.jsonl: 4 samples, tokenized now (cached)"]
    assert preprocess(recipe) == [f"data.train {tmp_path}/train.jsonl: 4 samples, read from the cache",
                                  f"data.eval {tmp_path}/eval.jsonl: 4 samples, read from the cache"]
    tokenized: list[str] = []
    hooks.register("tokenizing", lambda source: tokenized.append(source))
    cfg, _ = load_recipe(str(recipe))
    inputs = prepare.inputs(cfg, recipe_row(cfg))
    assert tokenized == [] and inputs.data.train is not None and inputs.data.train.cached
    # finetune run says so too: one line per source read from the cache (one tokenized now says so as it goes)
    assert prepare.report(cfg, inputs.data, hits_only=True) == preprocess(recipe)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"instruction": "Other.", "output": "x"}) + "\n")
    again = prepare.inputs(cfg, recipe_row(cfg))
    assert prepare.report(cfg, again.data, hits_only=True) == [
        f"data.train {tmp_path}/train.jsonl: 4 samples, read from the cache"]


def test_a_changed_data_file_is_tokenized_again(write_recipe: Callable[..., Path], tmp_path: Path) -> None:
    recipe = write_recipe()
    preprocess(recipe)
    (tmp_path / "train.jsonl").write_text(json.dumps({"instruction": "Other.", "output": "x"}) + "\n")
    assert preprocess(recipe) == [f"data.train {tmp_path}/train.jsonl: 1 sample, tokenized now (cached)"]


def test_run_says_which_sources_it_read_from_the_cache(write_recipe: Callable[..., Path], tmp_path: Path) -> None:
    recipe = write_recipe()
    preprocess(recipe)
    result = CliRunner().invoke(app, ["run", str(recipe), "-o", str(tmp_path / "run")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"data.train {tmp_path}/train.jsonl: 4 samples, read from the cache"


def test_preprocess_is_listed_in_the_help() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert "preprocess" in result.stdout


def _rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path.name


def test_preprocess_of_prompt_rows_says_they_were_tokenized_now(write_recipe: Callable[..., Path],
                                                                 tmp_path: Path) -> None:
    """Prompt rows (task grpo) report no progress per row; the line still tells a pass that ran from a cache hit."""
    recipe = write_recipe({"name": "g", "task": "grpo", "model": {"type": "tiny-llama"},
                           "data": {"format": "prompt", "train": _rows(tmp_path / "p.jsonl", PROMPTS)},
                           "train": {"max_steps": 1, "micro_batch_size": 2, "global_batch_size": 2},
                           "grpo": {"group_size": 2, "max_new_tokens": 4, "rewards": [{"exact_match": True}]}})
    assert preprocess(recipe) == [f"data.train {tmp_path}/p.jsonl: 20 samples, tokenized now (cached)"]
    assert preprocess(recipe) == [f"data.train {tmp_path}/p.jsonl: 20 samples, read from the cache"]


def _alive(group: int) -> list[int]:
    """The processes of process group ``group`` that still run (a zombie has ended)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _gone(group: int, within_s: float = 10.0) -> list[int]:
    """Wait until no process of ``group`` runs; those still running after ``within_s`` (each then killed)."""
    deadline = time.monotonic() + within_s
    while _alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _alive(group)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("command", "sig", "to_group", "code", "said"), [
    ("preprocess", signal.SIGKILL, False, -signal.SIGKILL, None),
    ("run", signal.SIGKILL, False, -signal.SIGKILL, None),
    ("preprocess", signal.SIGTERM, False, 143, TERMINATED),
    ("preprocess", signal.SIGTERM, True, 143, TERMINATED),  # timeout(1), Slurm: the workers get it too
    ("preprocess", signal.SIGINT, True, 130, "interrupted (Ctrl+C): `finetune preprocess` stopped before it finished"),
], ids=["sigkill", "sigkill-run", "sigterm", "sigterm-to-the-group", "ctrl-c"])
def test_a_command_stopped_while_its_workers_tokenize_leaves_nothing_that_blocks_the_next(
        write_recipe: Callable[..., Path], minimal_recipe: dict, tmp_path: Path, command: str, sig: int,
        to_group: bool, code: int, said: str | None) -> None:
    """data.num_proc: 2. The command is stopped once one worker holds its first row and the other has finished its
    shard (idle, waiting for the pool's next task). It ends with its exit code and at most one line (no traceback,
    no internal error), no worker outlives it, and the next preprocess of the same data tokenizes at once."""
    minimal_recipe["data"] = {"format": "chat", "train": _rows(tmp_path / "chat.jsonl", CHATS), "num_proc": 2}
    recipe = write_recipe(minimal_recipe)
    mark = tmp_path / "tokenizing.pid"
    env = {**os.environ, "PYTHONPATH": str(REPO), "FINETUNE_HOOKS": "tests.integration.kill_hooks",
           "FINETUNE_SLOW_TOKENIZE": str(mark)}
    argv = [sys.executable, "-m", "finetune", command, str(recipe)]
    argv += ["-o", str(tmp_path / "run")] if command == "run" else []
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a terminal's job is
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mark.exists(), proc.communicate(timeout=60)
        time.sleep(1.0)  # the other worker tokenizes its 100 rows and waits for the next task
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        err = proc.communicate(timeout=60)[1]
    finally:
        left = _gone(proc.pid)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert not left, f"processes outlived the stopped command: {left}"
    lines = [line for line in err.splitlines() if not line.startswith("tokenizing ")]
    assert len(lines) == (said is not None) and all(line.startswith(str(said)) for line in lines), err[-3000:]
    assert preprocess(recipe) == [f"data.train {tmp_path}/chat.jsonl: 200 samples, tokenized now (cached)"]


@pytest.mark.parametrize("planted", ["lock", "done"])
def test_the_cache_lock_and_marker_are_never_written_through_a_link(write_recipe: Callable[..., Path],
                                                                    tmp_path: Path, planted: str) -> None:
    """A symbolic link at the lock's or the marker's name (to a file of the user's, or to one that does not exist):
    preprocess works, the linked file is unchanged and nothing is created where the dangling link points."""
    recipe = write_recipe()
    cfg, _ = load_recipe(str(recipe))
    lock, done = prepare._lock_files(cfg)
    place = {"lock": lock, "done": done}[planted]
    place.parent.mkdir(parents=True, exist_ok=True)
    mine = tmp_path / "mine.txt"
    mine.write_text("my notes\n")
    for target in (mine, tmp_path / "nothing-here"):
        place.unlink(missing_ok=True)
        place.symlink_to(target)
        assert preprocess(recipe)[0].startswith(f"data.train {tmp_path}/train.jsonl: 4 samples")
        assert mine.read_text() == "my notes\n" and not (tmp_path / "nothing-here").exists()
        assert not place.is_symlink() and place.is_file()
