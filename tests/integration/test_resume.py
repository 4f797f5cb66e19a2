"""Exact resume: straight runs equal interrupted + resumed runs bit for bit on CPU fp32 (and fp16).

The interruptions are real: a SIGTERM to the training process (in-process through the CLI, and in a subprocess),
a SIGKILL during a step, and a SIGKILL in the middle of a checkpoint write (made slow by a test hook).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import (
    DATA,
    cli_exit_code,
    final_weights,
    run_stopped_after,
    tiny_recipe,
    with_sections,
    write_named,
)

pytestmark = pytest.mark.integration
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[2])}


SLOW_MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}


def resume_recipe(slow: bool = False, **sections) -> dict:
    """Dropout on, shuffle on, grad accumulation 2, warmup + cosine, a checkpoint every 2 steps.

    ``slow``: a larger model, so a step takes long enough for a kill at a random moment to land inside one.
    """
    overrides = {"attention_dropout": 0.1, **(SLOW_MODEL if slow else {})}
    base = tiny_recipe(
        model={"type": "tiny-llama", "config_overrides": overrides},
        train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 12},
        scheduler={"name": "cosine", "warmup_steps": 3},
        checkpoint={"every_steps": 2, "keep_last": 3},
        data={"eval": None},
    )
    return with_sections(base, **sections)


def _cli(*args: str) -> int:
    return cli_exit_code(*args)


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ after resume: {different[:5]}"


def _steps_logged(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if r["kind"] == "train"]


@pytest.mark.parametrize("case", ["mid_epoch", "across_epoch_boundary", "fp16", "packing_with_workers"])
def test_straight_equals_sigterm_and_resume(tmp_path: Path, case: str) -> None:
    """12 straight steps == 6 steps, SIGTERM (checkpoint, exit 143), `finetune resume`, 6 more; bit-identical."""
    sections: dict = {}
    if case == "across_epoch_boundary":  # 48 rows, 10 per step: epochs end inside steps 5 and 10
        sections = {"data": {"format": "completion", "train": str(DATA / "tiny_completion.jsonl"), "eval": None},
                    "train": {"micro_batch_size": 5, "global_batch_size": 10, "max_steps": 12}}
    if case == "fp16":
        sections = {"train": {"mixed_precision": "fp16"}}
    if case == "packing_with_workers":  # 2 DataLoader worker processes collate ahead: the same batches, in order
        sections = {"data": {"packing": True, "num_workers": 2}}
    recipe = resume_recipe(**sections)
    assert _cli("run", str(write_named(tmp_path, "straight", recipe))) == 0

    run_stopped_after(write_named(tmp_path, "resumed", recipe), 5)
    resumed = tmp_path / "resumed"
    assert (resumed / "checkpoints" / "step-000006").is_dir() and not (resumed / "final").exists()
    assert _cli("resume", str(resumed)) == 0

    _assert_identical(final_weights(tmp_path / "straight"), final_weights(resumed))
    assert _steps_logged(resumed) == list(range(1, 13))
    straight_rows = [r for r in read_metrics(tmp_path / "straight") if r["kind"] == "train"]
    resumed_rows = [r for r in read_metrics(resumed) if r["kind"] == "train"]
    assert [r["loss"] for r in resumed_rows] == [r["loss"] for r in straight_rows]
    if case == "fp16":  # the dynamic loss scale continues where it was saved
        assert [r["loss_scale"] for r in resumed_rows] == [r["loss_scale"] for r in straight_rows]
    log = (resumed / "train.log").read_text()
    assert "resume from step-000006" in log and "resumed from step-000006: step 6" in log
    state = json.loads((resumed / "checkpoints" / "step-000012" / "train_state.json").read_text())
    global_batch = recipe["train"]["global_batch_size"]
    assert state["step"] == 12 and state["samples_seen"] == 12 * global_batch and state["micro_step"] == 24
    assert state["epoch"] == 12 * global_batch // state["train_size"]


def _spawn(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "finetune", *args], env=env or ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _trained_steps(run: Path) -> int:
    try:
        return len([r for r in read_metrics(run) if r["kind"] == "train"])
    except Exception:
        return 0


@pytest.fixture(scope="module")
def straight_weights(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("straight")
    assert _cli("run", str(write_named(tmp, "straight", resume_recipe(slow=True)))) == 0
    return final_weights(tmp / "straight")


def test_sigkill_during_a_step_then_resume_is_exact(tmp_path: Path, straight_weights: dict) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    proc = _spawn("run", str(write_named(tmp_path, "killed", resume_recipe(slow=True))))
    run = tmp_path / "killed"
    _wait_for(lambda: _trained_steps(run) >= 3 or proc.poll() is not None)
    time.sleep(rng.uniform(0.0, 0.5))
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill (seed {seed})"
    done = _spawn("resume", str(run))
    out, _ = done.communicate(timeout=300)
    assert done.returncode == 0, out
    _assert_identical(straight_weights, final_weights(run))
    assert _steps_logged(run) == list(range(1, 13)), f"seed {seed}"


def test_sigkill_during_a_checkpoint_write_then_resume_is_exact(tmp_path: Path, straight_weights: dict) -> None:
    env = {**ENV, "FINETUNE_HOOKS": "tests.integration.kill_hooks", "FINETUNE_SLOW_CHECKPOINT": "6"}
    proc = _spawn("run", str(write_named(tmp_path, "killed", resume_recipe(slow=True))), env=env)
    run = tmp_path / "killed"
    _wait_for(lambda: (run / "checkpoints" / "slow-write-started").exists() or proc.poll() is not None)
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (run / "checkpoints" / "step-000006.tmp").is_dir()
    listing = subprocess.run([sys.executable, "-m", "finetune", "ls", str(run)], env=ENV, capture_output=True,
                             text=True)
    assert "step-000004" in listing.stdout and "incomplete write, ignored" in listing.stdout
    done = _spawn("resume", str(run))
    out, _ = done.communicate(timeout=300)
    assert done.returncode == 0, out
    assert "resume from step-000004" in (run / "train.log").read_text()
    assert not list((run / "checkpoints").glob("*.tmp")), "the next save removes a crashed .tmp"
    _assert_identical(straight_weights, final_weights(run))


def test_sigterm_subprocess_exits_143_with_a_checkpoint(tmp_path: Path, straight_weights: dict) -> None:
    proc = _spawn("run", str(write_named(tmp_path, "termed", resume_recipe(slow=True))))
    run = tmp_path / "termed"
    _wait_for(lambda: _trained_steps(run) >= 3 or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "finetune resume" in out
    steps = _trained_steps(run)
    assert (run / "checkpoints" / f"step-{steps:06d}").is_dir()
    done = _spawn("resume", str(run))
    out, _ = done.communicate(timeout=300)
    assert done.returncode == 0, out
    _assert_identical(straight_weights, final_weights(run))


def _refusal(tmp_path: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "finetune", "resume", *args], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def test_refusals(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    shutil.copy(DATA / "tiny_completion.jsonl", data)
    recipe = resume_recipe(data={"format": "completion", "train": str(data), "eval": None},
                           train={"max_steps": 4}, checkpoint={"every_steps": 2})
    assert _cli("run", str(write_named(tmp_path, "r", recipe))) == 0
    run = tmp_path / "r"

    err = _refusal(tmp_path, str(run), "optim.lr=0.5")
    assert "optim.lr: 0.001 -> 0.5" in err and "--allow-config-change" in err

    data.write_text(data.read_text().replace("the", "a"))
    err = _refusal(tmp_path, str(run))
    assert "data.train" in err and "changed since the checkpoint" in err
    shutil.copy(DATA / "tiny_completion.jsonl", data)

    (run / "checkpoints" / "step-000004" / "manifest.json").write_text("{not json")
    err = _refusal(tmp_path, str(run), "--from", "step-000004")
    assert "manifest.json is corrupted" in err
    shutil.rmtree(run / "checkpoints" / "step-000002")
    err = _refusal(tmp_path, str(run))
    assert "no complete resumable checkpoint" in err and "manifest.json is corrupted" in err

    shutil.rmtree(run / "checkpoints")
    err = _refusal(tmp_path, str(run))
    assert "no complete resumable checkpoint" in err and "finetune run" in err
    assert "not a run directory" in _refusal(tmp_path, str(tmp_path / "nothing"))


def test_the_worker_reads_the_resumed_checkpoints_manifest_once(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The front process verified the checkpoint; the worker reads its manifest once and hands it to the progress
    display, the checks and the loaders."""
    from finetune.runtime import worker
    from finetune.storage import rundir

    recipe = resume_recipe(train={"max_steps": 4}, checkpoint={"every_steps": 2})
    run_stopped_after(write_named(tmp_path, "r", recipe), 1)
    ckpt = (tmp_path / "r" / "checkpoints" / "step-000002").resolve()
    reads, in_worker = [], []
    real_read, real_worker = rundir.read_manifest, worker.run_worker

    def counted(path: Path, *args: Any, **kwargs: Any) -> Any:
        if in_worker and Path(path).resolve() == ckpt:
            reads.append(path)
        return real_read(path, *args, **kwargs)

    def worker_run(*args: Any, **kwargs: Any) -> Any:
        in_worker.append(True)
        try:
            return real_worker(*args, **kwargs)
        finally:
            in_worker.clear()

    monkeypatch.setattr(rundir, "read_manifest", counted)
    monkeypatch.setattr(worker, "run_worker", worker_run)
    assert _cli("resume", str(tmp_path / "r")) == 0
    assert len(reads) == 1, reads


def test_allowed_change_is_logged_and_layout_changes_need_no_flag(tmp_path: Path) -> None:
    recipe = resume_recipe(train={"max_steps": 4}, checkpoint={"every_steps": 2})
    run_stopped_after(write_named(tmp_path, "r", recipe), 1)
    run = tmp_path / "r"
    # micro batch 2 x accum 4 instead of 4 x 2: same global batch, same math, no flag needed
    assert _cli("resume", str(run), "train.micro_batch_size=2", "train.max_steps=6", "--allow-config-change") == 0
    log = (run / "train.log").read_text()
    assert "resume: changed train.max_steps: 4 -> 6 (allowed)" in log
    assert "resume: layout train.micro_batch_size: 4 -> 2" in log
    assert _steps_logged(run) == [1, 2, 3, 4, 5, 6]


def test_an_allowed_change_of_the_optimizer_trains_with_the_recipes_values(tmp_path: Path) -> None:
    """`finetune resume RUN optim.lr=... --allow-config-change` (the fix a diverged or collapsed run's line gives)
    trains on with the new lr on the recipe's schedule, and a new weight decay: the checkpoint's optimizer and
    schedule state would otherwise bring back the values it was saved with."""
    from finetune.config.schema import SchedulerConfig
    from finetune.runtime.optim import lr_factor

    recipe = resume_recipe(train={"max_steps": 6}, checkpoint={"every_steps": 2}, optim={"lr": 1e-3})
    run_stopped_after(write_named(tmp_path, "r", recipe), 1)
    run = tmp_path / "r"
    assert _cli("resume", str(run), "optim.lr=1e-4", "optim.weight_decay=0.1", "--allow-config-change") == 0
    schedule = SchedulerConfig(**recipe["scheduler"])
    rows = {r["step"]: r["lr"] for r in read_metrics(run) if r["kind"] == "train"}
    assert [rows[s] for s in (1, 2)] == pytest.approx([1e-3 * lr_factor(s - 1, schedule, 6) for s in (1, 2)])
    later = (3, 4, 5, 6)
    assert [rows[s] for s in later] == pytest.approx([1e-4 * lr_factor(s - 1, schedule, 6) for s in later])
    log = (run / "train.log").read_text()
    assert "resume: optimizer group 0 initial_lr: 0.001 -> 0.0001 (the recipe's, not the checkpoint's)" in log
    assert "resume: optimizer group 0 weight_decay: 0.0 -> 0.1" in log
    assert "group 1 weight_decay" not in log  # biases and norms never decay


def _as_an_older_finetune_wrote_it(run: Path) -> None:
    """Drop data.add_bos from every recipe the run holds (finetune wrote none before the key existed), and list the
    changed files in each checkpoint's manifest as that finetune would have."""
    import yaml

    from finetune.storage import rundir
    from tests.recipe_files import write_recipe_file

    for recipe in [run / rundir.RESOLVED, *run.glob(f"checkpoints/*/{rundir.RESOLVED}")]:
        data = yaml.safe_load(recipe.read_text())
        del data["data"]["add_bos"]
        write_recipe_file(recipe, data)
        if recipe.parent != run:
            rundir.write_manifest(recipe.parent, {k: v for k, v in rundir.read_manifest(recipe.parent).items()
                                                  if k != "files"})


def test_a_run_trained_before_data_add_bos_resumes_with_the_rule_it_trained_with(tmp_path: Path) -> None:
    """A run finetune wrote before data.add_bos existed put bos before every chat; its recipes lack the key. It
    resumes with that rule (always), bit for bit as a straight run of it, not with today's default (auto)."""
    recipe = resume_recipe(data={"format": "chat", "train": str(DATA / "tiny_chat.jsonl"), "add_bos": "always"},
                           train={"max_steps": 4})
    assert _cli("run", str(write_named(tmp_path, "straight", recipe))) == 0
    run_stopped_after(write_named(tmp_path, "older", recipe), 1)
    older = tmp_path / "older"
    _as_an_older_finetune_wrote_it(older)
    assert _cli("resume", str(older)) == 0
    _assert_identical(final_weights(tmp_path / "straight"), final_weights(older))
    assert "add_bos: always" in (older / "final" / "recipe.resolved.yaml").read_text()
