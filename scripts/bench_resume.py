"""Benchmark: seconds from `finetune resume` start to the first new optimizer step, at sample 100 vs 1,000,000.

    .venv/bin/python scripts/bench_resume.py [--workdir /tmp/bench-resume] [--repeats 3]

1. Writes a synthetic completion dataset of 1,100,000 rows (5 random letters each).
2. Run A trains one step (global batch 100: sample 100), run B the same recipe for 10,000 steps (sample
   1,000,000); at that step a hook saves a checkpoint with the loop's own ``checkpoint.save`` and exits.
3. Times `finetune resume` of A and of B, alternating, ``--repeats`` times each: from process start until the first
   new optimizer step ends (a hook records the time and exits). Prints both medians and their ratio.

The data cursor is "samples consumed" under a seeded per-epoch permutation, so both resumes do the same work;
nothing iterates over consumed batches. This file is also the hook module (FINETUNE_HOOKS=bench_resume).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROWS = 1_100_000
GLOBAL_BATCH = 100
LONG_STEPS = 10_000


def _register_hooks() -> None:
    from finetune import hooks
    from finetune.artifacts import checkpoint

    save_at = int(os.environ.get("BENCH_SAVE_AND_EXIT_AT", "0"))
    first_step_file = os.environ.get("BENCH_FIRST_STEP_FILE")

    def after_step(trainer: Any) -> None:  # a finetune.runtime.loop.Trainer
        if save_at and trainer.state.step == save_at:
            checkpoint.save(trainer.ctx, trainer.state, trainer.objects)
            trainer.tracker.close()
            os._exit(0)
        if first_step_file:
            Path(first_step_file).write_text(repr(time.time()))
            os._exit(0)

    hooks.register("after_step", after_step)


if os.environ.get("FINETUNE_HOOKS") == "bench_resume":
    _register_hooks()


def _recipe(workdir: Path, name: str) -> Path:
    recipe = {
        "name": name, "output_dir": str(workdir / name),
        "model": {"type": "tiny-llama"},
        "data": {"format": "completion", "train": str(workdir / "big.jsonl"), "max_seq_len": 16},
        "train": {"micro_batch_size": GLOBAL_BATCH, "global_batch_size": GLOBAL_BATCH, "max_steps": LONG_STEPS + 100},
        "optim": {"lr": 1e-3}, "scheduler": {"name": "constant"},
        "checkpoint": {"every_steps": None, "keep_last": 1, "save_final": False},
        "logging": {"every_steps": 1000, "progress": False},
    }
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def _finetune(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "finetune", *args], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-resume"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    workdir: Path = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "FINETUNE_HOOKS": "bench_resume",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    data = workdir / "big.jsonl"
    if not data.is_file():
        rng = random.Random(0)
        letters = "abcdefghijklmnopqrstuvwxyz"
        with data.open("w") as handle:
            for _ in range(ROWS):
                handle.write(json.dumps({"text": " ".join(rng.choice(letters) for _ in range(5))}) + "\n")
    runs = {"sample 100": workdir / "A", "sample 1,000,000": workdir / "B"}
    if not (runs["sample 100"] / "checkpoints" / "step-000001").is_dir():
        start = time.perf_counter()
        _finetune("run", str(_recipe(workdir, "A")), "--overwrite", env={**env, "BENCH_SAVE_AND_EXIT_AT": "1"})
        print(f"run A (1 step, includes tokenizing {ROWS} rows on first use): {time.perf_counter() - start:.0f} s")
    if not (runs["sample 1,000,000"] / "checkpoints" / f"step-{LONG_STEPS:06d}").is_dir():
        start = time.perf_counter()
        _finetune("run", str(_recipe(workdir, "B")), "--overwrite",
                  env={**env, "BENCH_SAVE_AND_EXIT_AT": str(LONG_STEPS)})
        print(f"run B ({LONG_STEPS} steps): {time.perf_counter() - start:.0f} s")
    times: dict[str, list[float]] = {label: [] for label in runs}
    marker = workdir / "first-step.txt"
    for _ in range(args.repeats):
        for label, run in runs.items():
            marker.unlink(missing_ok=True)
            start = time.time()
            _finetune("resume", str(run), env={**env, "BENCH_FIRST_STEP_FILE": str(marker)})
            times[label].append(float(marker.read_text()) - start)
    medians = {label: statistics.median(values) for label, values in times.items()}
    for label, values in times.items():
        print(f"resume at {label:>16}: median {medians[label]:.2f} s  (runs: {', '.join(f'{v:.2f}' for v in values)})")
    ratio = medians["sample 1,000,000"] / medians["sample 100"]
    print(f"ratio (1,000,000 / 100): {ratio:.3f}")


if __name__ == "__main__":
    main()
