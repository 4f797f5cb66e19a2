"""finetune.runtime.worker's parts that need no model: the run context it builds once (and its refusal of a
process count other than the recipe's), the run's first log line, the step a resume continues from, and the exit of
a run stopped by a signal (rank 0's exit prints the stop line, the worker's log row is for train.log only, and every
other rank of a launched run exits with the same code in silence)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from finetune.backends import backend_named
from finetune.config import RecipeConfig
from finetune.errors import ConfigError, Interrupted
from finetune.registry import SUPPORTED_MODELS
from finetune.runtime import plan, worker
from finetune.storage import rundir

STOP = "stopped by signal after step 2; checkpoint step-000002 saved; continue with `finetune resume runs/x`"
ROW = SUPPORTED_MODELS["tiny-llama"]


def _recipe(**train: Any) -> RecipeConfig:
    return RecipeConfig.model_validate({"name": "tiny", "model": {"type": "tiny-llama"},
                                        "data": {"format": "alpaca", "train": "t.jsonl"},
                                        "train": {"micro_batch_size": 2, "global_batch_size": 4, **train}})


def _accelerator(processes: int) -> Any:
    return SimpleNamespace(num_processes=processes, distributed_type="MULTI_CPU", wait_for_everyone=lambda: None)


def _inputs(train_size: int) -> Any:
    data = SimpleNamespace(train=object(), train_size=train_size, labels=["neg", "pos"])
    return SimpleNamespace(tokenizer="the tokenizer", data=data)


@pytest.fixture
def marked_run(tmp_path: Path) -> Path:
    """A folder that is a finetune run (its marker names run id ``id-7``)."""
    (tmp_path / rundir.MARKER).write_text(json.dumps({"run_id": "id-7"}))
    return tmp_path


def test_the_context_holds_the_runs_facts_and_its_length_in_steps(marked_run: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, backend = _accelerator(1), SimpleNamespace(name="single")
    monkeypatch.setattr(worker, "make_accelerator", lambda cfg, row, wanted: (accelerator, backend))
    cfg = _recipe(epochs=1)
    ctx = worker._context(cfg, marked_run, ROW, SimpleNamespace(name="asked"), _inputs(train_size=10))
    assert (ctx.cfg, ctx.run_dir, ctx.run_id, ctx.row) == (cfg, marked_run, "id-7", ROW)
    assert (ctx.labels, ctx.backend, ctx.accelerator, ctx.tokenizer) == (["neg", "pos"], backend, accelerator,
                                                                          "the tokenizer")
    assert ctx.max_steps == 3  # one pass over 10 rows in batches of 4: the last batch is whole


def test_a_process_count_other_than_the_recipes_is_refused(marked_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker, "make_accelerator", lambda cfg, row, wanted: (_accelerator(2), wanted))
    with pytest.raises(ConfigError, match=r"^launch\.num_processes=1 but 2 process\(es\) are running; set "
                                          r"launch\.num_processes=2$"):
        worker._context(_recipe(max_steps=5), marked_run, ROW, SimpleNamespace(name="single"), _inputs(train_size=10))


@pytest.mark.parametrize(("streamed", "samples"), [(False, "10 train samples"), (True, "streamed train samples")])
def test_the_first_line_says_the_length_the_batch_and_the_backend(marked_run: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   streamed: bool, samples: str) -> None:
    monkeypatch.setattr(worker, "make_accelerator", lambda cfg, row, wanted: (_accelerator(1), wanted))
    ctx = worker._context(_recipe(max_steps=5), marked_run, ROW, SimpleNamespace(name="single"), _inputs(train_size=10))
    assert worker.training_line(ctx, streamed, 10) == (
        "training tiny: 5 steps, global batch 4 (micro 2 x accum 2 x 1 process(es)), backend single (MULTI_CPU), "
        + samples)


def test_resumed_step_reads_the_checkpoint_manifest(tmp_path: Path) -> None:
    assert worker.resumed_step(worker.resumed_manifest(None)) == 0
    ckpt = tmp_path / "step-000120"
    ckpt.mkdir()
    assert worker.resumed_manifest(ckpt) is None  # no manifest: loading the checkpoint reports it, not this
    (ckpt / rundir.MANIFEST).write_text(json.dumps({"kind": "checkpoint", "step": 120, "files": {}}))
    assert worker.resumed_step(worker.resumed_manifest(ckpt)) == 120
    (ckpt / rundir.MANIFEST).write_text(json.dumps({"kind": "checkpoint", "step": "x", "files": {}}))
    assert worker.resumed_step(worker.resumed_manifest(ckpt)) == 0


@pytest.mark.parametrize(("rank", "lines"), [("0", [STOP]), ("1", [])])
def test_each_rank_exits_130_and_only_rank_0_says_why(rank: str, lines: list[str], monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def stopped(*_args: object, **_kwargs: object) -> None:
        raise Interrupted(STOP, 130)

    monkeypatch.setattr(worker, "run_worker", stopped)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("FINETUNE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as done:
        worker.execute(Path("runs/x/recipe.resolved.yaml"))
    out, err = capsys.readouterr()
    assert done.value.code == 130 and out == "" and err.splitlines() == lines


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_ctrl_c_before_the_loop_is_one_line_for_all_ranks_naming_the_users_command(
        rank: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A Ctrl+C that the launcher passes on while the ranks still load the model (no step to stop after): each rank
    exits 130, and only rank 0 says so, in the words of one process (the command the user typed, which the front
    process hands on, not the worker's own command line)."""
    import signal
    import time

    def loading(*_args: object, **_kwargs: object) -> None:
        signal.raise_signal(signal.SIGINT)  # to this (the main) thread, as the launcher's signal arrives
        time.sleep(5)

    monkeypatch.setattr(worker, "run_worker", loading)
    monkeypatch.setattr("sys.argv", ["/x/finetune/runtime/worker.py", "runs/x/recipe.resolved.yaml"])
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("FINETUNE_COMMAND", "finetune run")  # what launch.child_env hands on
    monkeypatch.delenv("FINETUNE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as done:
        worker.execute(Path("runs/x/recipe.resolved.yaml"))
    out, err = capsys.readouterr()
    assert done.value.code == 130 and out == ""
    said = err.splitlines()
    if rank == "0":
        assert len(said) == 1 and said[0].startswith("interrupted (Ctrl+C): `finetune run` stopped before it "), said
    else:
        assert said == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_plan_decides_whether_unsharded_gradients_fit(monkeypatch) -> None:
    """On GPUs the worker asks finetune.runtime.plan about the smallest visible device; on the CPU, without accumulation
    or without an answer it reduce-scatters every micro-step."""
    fsdp1, fsdp2, ddp = backend_named("fsdp1"), backend_named("fsdp2"), backend_named("ddp")
    accumulating, once = SimpleNamespace(grad_accum=2), SimpleNamespace(grad_accum=1)
    assert worker.fsdp_accumulation(accumulating, fsdp2) == fsdp2  # this CPU machine: no question asked
    asked: list[int] = []
    answer = {"fits": True}

    def fits(cfg: object, device_bytes: int) -> bool:
        asked.append(device_bytes)
        if answer["fits"] is None:
            raise RuntimeError("no plan for this model")
        return answer["fits"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plan, "visible_devices", lambda: [("cuda:0", 80 << 30), ("cuda:1", 40 << 30)])
    monkeypatch.setattr(plan, "unsharded_accumulation_fits", fits, raising=False)
    assert not worker.fsdp_accumulation(accumulating, fsdp1).syncs_each_micro_step
    answer["fits"] = False
    assert worker.fsdp_accumulation(accumulating, fsdp2).syncs_each_micro_step
    answer["fits"] = None
    assert worker.fsdp_accumulation(accumulating, fsdp2).syncs_each_micro_step
    assert asked == [40 << 30] * 3
    assert worker.fsdp_accumulation(once, fsdp2) == fsdp2
    assert worker.fsdp_accumulation(accumulating, ddp) == ddp
    assert len(asked) == 3
