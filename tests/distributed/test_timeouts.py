"""Multi-node without timeouts or races, on 2 "machines" of one CPU process each (two `accelerate launch
--num_machines 2 --machine_rank R -m finetune run`, as accelerate_configs/multi_node_example.yaml says to start a
multi-node run) that share the run folder's parent and the datasets cache, under launch.timeout_minutes=0.1 (6 s).

tests/distributed/slow_rank_hooks.py makes the process that really tokenizes sleep 9 s (a large dataset), and rank 0
sleep 9 s before it hashes its checkpoint (a 7B model's ~90 GB). Before the fix rank 0 tokenized inside the process
group while rank 1 waited at a barrier, and rank 1 waited at a barrier while rank 0 hashed: both waits outlived the
timeout and the run failed. Now the tokenizing happens before the process group exists (the other process waits on
a file lock, then reads the cache), and the hashing runs on a thread that no collective waits for.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.storage import checkpoints, rundir
from tests.integration.conftest import tiny_recipe
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
SLOW_S = 9  # each slow part: longer than the 6 s timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_with_a_slow_rank_0_under_a_short_timeout(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    write_recipe_file(recipe, tiny_recipe(
        train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 4},
        checkpoint={"every_steps": 4, "save_final": False},  # the last step's checkpoint, then the final eval
        eval={"metrics": ["token_accuracy"], "batch_size": 50},
        launch={"timeout_minutes": 0.1}))
    notes, run = tmp_path / "notes", tmp_path / "run"
    notes.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),  # cold: the tokenizing really runs
           "FINETUNE_HOOKS": "tests.distributed.slow_rank_hooks", "FINETUNE_SLOW_NOTES": str(notes),
           "FINETUNE_SLOW_TOKENIZE_S": str(SLOW_S), "FINETUNE_SLOW_HASH_S": str(SLOW_S)}
    port = _free_port()
    machines = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/ddp.yaml"),
         "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
         "--main_process_port", str(port), "--num_processes", "2",
         "-m", "finetune", "run", str(recipe), "-o", str(run)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [machine.communicate(timeout=400) for machine in machines]
    for rank, (machine, (_, err)) in enumerate(zip(machines, outputs, strict=True)):
        assert machine.returncode == 0, f"machine {rank}: {err[-3000:]}"

    tokenized = sorted(p.name for p in notes.glob("tokenized-*"))
    assert len(tokenized) == 1, tokenized  # one process filled the shared cache; the other read it
    for rank in (0, 1):  # the recipe's timeout is the process group's
        assert float((notes / f"pg-timeout-{rank}").read_text()) == 6.0
    hashed = json.loads((notes / "hashed").read_text())
    assert hashed["checkpoint"] == "step-000004.tmp" and hashed["end"] - hashed["start"] >= SLOW_S
    # the run folder was created and locked once (by global rank 0) and holds only finetune's entries
    assert rundir.foreign_entries(run) == []
    info = checkpoints.inspect(run / "checkpoints" / "step-000004")
    assert info.resumable, info.reason
    checkpoints.verify(info.path, rundir.run_id(run))  # the manifest hashed after the other rank went on
    log = (run / "train.log").read_text()
    assert "step 4/4" in log and "eval step 4" in log, log[-2000:]
