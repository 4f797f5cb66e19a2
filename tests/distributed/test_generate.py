"""`finetune generate --num-processes 2` (accelerate launch, ddp over gloo on CPU) writes the file one process
writes: every prompt exactly once, in input order, with the same sampled completions.

Both commands go through the real CLI in fresh processes (`python -m finetune generate ...`, which execs
`accelerate launch ... -m finetune.commands.generate` for 2 processes), as tests/distributed/test_backends.py runs
training. """

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import DATA, trained_run

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
PROMPTS = 13  # odd: the two ranks get 7 and 6 prompts, and batches of 4 leave a partial one on each


def _finetune(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "finetune", *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=600)


def test_two_processes_write_the_one_process_file(tmp_path: Path) -> None:
    run = trained_run(tmp_path, "gen", train={"max_steps": 8}, data={"eval": None})
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in (DATA / "reverse_eval.jsonl").read_text().splitlines()[:PROMPTS - 1]]
    lines = [{"id": i, **row} for i, row in enumerate(rows)] + [{"id": PROMPTS - 1, "prompt": "hello"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = ["--max-new-tokens", "8", "--temperature", "0.9", "--seed", "5", "--batch-size", "4"]

    one = _finetune("generate", run, prompts, "-o", tmp_path / "one.jsonl", *flags)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _finetune("generate", run, prompts, "-o", tmp_path / "two.jsonl", *flags, "--num-processes", "2",
                    "--accelerate-config", "ddp")
    assert two.returncode == 0, two.stderr[-3000:]

    assert "on 1 process(es)" in one.stdout and "on 2 process(es)" in two.stdout, (one.stdout, two.stdout)
    assert f"generate: 7/7 prompts (this process's share; {PROMPTS} in all over 2 processes)" in two.stdout
    written = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [row["id"] for row in written] == list(range(PROMPTS))  # each prompt once, in input order
    assert all(row["finish_reason"] in ("eos", "length") for row in written)
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".jsonl") == ["one.jsonl", "prompts.jsonl",
                                                                                   "two.jsonl"]
