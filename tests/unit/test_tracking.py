"""Metric sinks: the log(kind, row) protocol, file formats, tok/s and ETA, rank and terminal gating, eval lines,
wandb offline resume, tensorboard."""

from __future__ import annotations

import inspect
import io
import os
import re
import sys
from pathlib import Path

import pytest

from finetune.config.schema import RecipeConfig
from finetune.errors import ConfigError
from finetune.runtime.tracking import (
    NO_WANDB,
    Eta,
    JsonlTracker,
    MultiTracker,
    NullTracker,
    ProgressTracker,
    TensorboardTracker,
    Throughput,
    TrainLogTracker,
    WandbTracker,
    build_tracker,
    format_eval_line,
)
from finetune.storage import rundir
from finetune.storage.metrics import format_metrics, read_metrics

TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} ")
TRAIN_ROW = {"step": 10, "loss": 2.31412, "lr": 3e-4, "grad_norm": 1.0212, "tokens": 51200, "elapsed_s": 10.0,
             "tokens_per_s": 5120.0}
EVAL_ROW = {"step": 50, "eval_loss": 1.23449, "eval_ppl": 3.4364, "eval_samples": 32, "eval_exact_match": 0.8125,
            "eval_exact_match_correct": 26, "eval_exact_match_total": 32, "eval_correct": 26, "eval_total": 32}
SINKS = (NullTracker, MultiTracker, JsonlTracker, TrainLogTracker, ProgressTracker, WandbTracker, TensorboardTracker)


def make_cfg(max_steps: int = 10, **logging: object) -> RecipeConfig:
    """A minimal valid recipe, with the given logging section."""
    return RecipeConfig.model_validate({
        "name": "t",
        "model": {"type": "tiny-llama"},
        "data": {"format": "alpaca", "train": "x.jsonl"},
        "train": {"max_steps": max_steps, "micro_batch_size": 1, "global_batch_size": 1},
        "logging": {"progress": False, **logging},
    })


def grpo_cfg(**grpo: object) -> RecipeConfig:
    """A minimal valid GRPO recipe with the given grpo keys (no progress bar)."""
    return RecipeConfig.model_validate({
        "name": "g", "task": "grpo", "model": {"type": "tiny-llama"},
        "data": {"format": "prompt", "train": "x.jsonl"},
        "train": {"max_steps": 10, "micro_batch_size": 1, "global_batch_size": 1},
        "grpo": {"rewards": [{"exact_match": True}], **grpo},
        "logging": {"progress": False},
    })


def log_lines(run_dir: Path) -> list[str]:
    """train.log without the timestamps (each line must carry one)."""
    lines = (run_dir / "train.log").read_text(encoding="utf-8").splitlines()
    assert all(TIMESTAMP.match(line) for line in lines), lines
    return [TIMESTAMP.sub("", line) for line in lines]


def info(message: str) -> dict[str, str]:
    return {"message": message}


class FakeTerminal(io.StringIO):
    """A stream that claims to be a terminal, to exercise the live progress bar."""

    def isatty(self) -> bool:
        return True


# ------------------------------------------------------------------------------------------------ the protocol


@pytest.mark.parametrize("sink", SINKS, ids=[s.__name__ for s in SINKS])
def test_every_sink_has_only_log_and_close(sink: type) -> None:
    public = {name for name, member in inspect.getmembers(sink) if not name.startswith("_") and callable(member)}
    assert public == {"log", "close"}
    assert list(inspect.signature(sink.log).parameters) == ["self", "kind", "row"]


def test_multi_tracker_fans_out_in_order_and_rejects_an_unknown_kind(tmp_path: Path) -> None:
    seen: list[tuple[str, str, object]] = []

    class Recorder(NullTracker):
        def __init__(self, name: str) -> None:
            self.name = name

        def log(self, kind: str, row: dict) -> None:
            seen.append((self.name, kind, row.get("step", row.get("message"))))

    tracker = MultiTracker([Recorder("a"), Recorder("b")])
    tracker.log("train", TRAIN_ROW)
    tracker.log("info", info("hello"))
    assert seen == [("a", "train", 10), ("b", "train", 10), ("a", "info", "hello"), ("b", "info", "hello")]
    with pytest.raises(ValueError, match="unknown row kind 'metric'"):
        tracker.log("metric", TRAIN_ROW)


def test_multi_tracker_closes_all_even_if_one_raises(tmp_path: Path) -> None:
    class Broken(NullTracker):
        def close(self) -> None:
            raise RuntimeError("boom")

    jsonl = JsonlTracker(tmp_path)
    tracker = MultiTracker([Broken(), jsonl])
    tracker.log("train", TRAIN_ROW)
    with pytest.raises(RuntimeError, match="boom"):
        tracker.close()
    with pytest.raises(ValueError, match="closed"):
        jsonl.log("train", TRAIN_ROW)


# ------------------------------------------------------------------------------------------- metrics.jsonl


def test_jsonl_rows_round_trip_with_kinds(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    tracker.log("train", TRAIN_ROW)
    tracker.log("info", info("not a metric"))
    tracker.log("eval", EVAL_ROW)
    tracker.close()
    assert read_metrics(tmp_path) == [{"kind": "train", **TRAIN_ROW}, {"kind": "eval", **EVAL_ROW}]


def test_jsonl_is_flushed_per_row_and_appends(tmp_path: Path) -> None:
    first = JsonlTracker(tmp_path)
    first.log("train", TRAIN_ROW)
    assert len(read_metrics(tmp_path)) == 1  # readable before close
    first.close()
    second = JsonlTracker(tmp_path)  # a resumed run appends
    second.log("train", {**TRAIN_ROW, "step": 20})
    second.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [10, 20]


# ------------------------------------------------------------------------------------------------ train.log


def test_train_log_line_format(tmp_path: Path) -> None:
    tracker = TrainLogTracker(tmp_path, max_steps=200)
    tracker.log("train", TRAIN_ROW)
    tracker.log("train", {**TRAIN_ROW, "step": 20, "tokens_per_s": 2047.6, "loss_scale": 65536.0, "skipped": True})
    tracker.log("train", {**TRAIN_ROW, "step": 21, "loss": float("nan"), "nonfinite": True, "skipped": True})
    tracker.log("info", info("saved checkpoint step-000100"))
    tracker.close()
    assert log_lines(tmp_path) == [
        "step 10/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120",
        "step 20/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 2048 | loss_scale 65536 | skipped (overflow)",
        "step 21/200 | loss nan | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120 | skipped (non-finite)",
        "saved checkpoint step-000100",
    ]


def test_train_log_shows_the_rows_tok_s_and_no_length_when_unknown(tmp_path: Path) -> None:
    tracker = TrainLogTracker(tmp_path, max_steps=None)
    tracker.log("train", {**TRAIN_ROW, "tokens_per_s": 123.4})
    tracker.log("train", {key: value for key, value in TRAIN_ROW.items() if key != "tokens_per_s"})
    tracker.close()
    assert log_lines(tmp_path) == ["step 10 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 123",
                                   "step 10 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02"]


def test_eval_line_shows_each_metric_once_as_correct_over_total(tmp_path: Path) -> None:
    tracker = TrainLogTracker(tmp_path, max_steps=200)
    tracker.log("eval", EVAL_ROW)
    tracker.log("eval", {"step": 60, "eval_loss": 1.0, "eval_ppl": 2.72, "eval_exact_match": 0.5,
                         "eval_exact_match_correct": 16, "eval_exact_match_total": 32, "eval_token_accuracy": 0.75,
                         "eval_token_accuracy_correct": 300, "eval_token_accuracy_total": 400,
                         "eval_correct": 16, "eval_total": 32})
    tracker.close()
    assert log_lines(tmp_path) == [
        "eval step 50 | eval_loss = 1.2345 | eval_ppl = 3.4364 | eval_samples = 32 | eval_exact_match 26/32 = 0.8125",
        "eval step 60 | eval_loss = 1.0000 | eval_ppl = 2.7200 | eval_exact_match 16/32 = 0.5000"
        " | eval_token_accuracy 300/400 = 0.7500",
    ]


# ------------------------------------------------------------------------------------ metric lines (eval CLI)


def test_format_eval_line_matches_the_metric_lines() -> None:
    assert format_eval_line(EVAL_ROW) == " | ".join(["eval step 50", *format_metrics(EVAL_ROW, skip=("step",))])


# ------------------------------------------------------------------------------------------ tok/s and ETA


def test_throughput_is_the_rate_between_successive_rows() -> None:
    rates = Throughput()
    assert rates.update(1000, 2.0) == 500  # the first row: from the start of the run
    assert rates.update(4000, 3.0) == 3000  # (4000 - 1000) / (3 - 2)
    assert rates.update(5000, 7.0) == 250  # (5000 - 4000) / (7 - 3)
    assert rates.update(5000, 7.0) == 0.0  # no time passed: no rate, no division by zero


def test_throughput_of_a_resumed_run_does_not_count_the_resumed_tokens() -> None:
    """Resumed at 1,000,000 tokens after 2000 s, then 10,000 tokens in 10 s: 1000 tok/s. A baseline at zero would
    give the run average (1,010,000 / 2010 = 502 tok/s); the resumed tokens counted as this process's work would
    give 1,010,000 / 10 = 101,000 tok/s."""
    rates = Throughput(tokens=1_000_000, elapsed_s=2000.0)
    assert rates.update(1_010_000, 2010.0) == pytest.approx(1000.0)
    assert rates.update(1_030_000, 2020.0) == pytest.approx(2000.0)


def test_eta_uses_only_this_process_pace() -> None:
    eta = Eta(max_steps=200)
    assert eta.update(60, 1010.0) is None  # first row of a run resumed at step 50 after 1000 s: no pace yet
    assert eta.update(70, 1020.0) == pytest.approx(130.0)  # 10 steps in 10 s; 130 steps left
    assert eta.update(200, 1150.0) == 0.0
    assert Eta(max_steps=None).update(10, 1.0) is None


# ------------------------------------------------------------------------------------------- console output


def test_progress_without_a_terminal_prints_exactly_one_line_per_row() -> None:
    out, err = io.StringIO(), io.StringIO()  # isatty() is False, as for a pipe or a log file
    tracker = ProgressTracker(200, start_step=0, stream=out, warn_stream=err)
    assert not tracker.active
    tracker.log("info", info("training t: 200 steps"))
    tracker.log("train", TRAIN_ROW)
    tracker.log("eval", EVAL_ROW)
    tracker.log("train", {**TRAIN_ROW, "step": 20, "tokens_per_s": 4000.0})
    tracker.log("info", {"message": "warning: warmup is longer than the run", "level": "warning"})
    tracker.close()
    assert out.getvalue().splitlines() == [
        "training t: 200 steps",
        "step 10/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120",
        format_eval_line(EVAL_ROW),
        "step 20/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 4000",
    ]
    assert err.getvalue() == "warning: warmup is longer than the run\n"


def test_a_log_only_event_is_not_printed() -> None:
    """A row marked ``console: False`` (a stop line, which the exit prints once) goes to train.log only."""
    out, err = io.StringIO(), io.StringIO()
    console = ProgressTracker(4, bar=False, stream=out, warn_stream=err)
    console.log("info", {"message": "stopped by signal after step 2", "console": False})
    console.log("info", {"message": "saved checkpoint step-000002"})
    assert out.getvalue() == "saved checkpoint step-000002\n" and err.getvalue() == ""


def test_progress_lines_also_on_a_terminal_when_the_bar_is_off() -> None:
    stream = FakeTerminal()
    tracker = ProgressTracker(200, bar=False, stream=stream)
    tracker.log("train", TRAIN_ROW)
    tracker.close()
    assert not tracker.active
    assert stream.getvalue() == "step 10/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120\n"


def test_progress_bar_of_a_resumed_run_starts_at_its_step() -> None:
    stream = FakeTerminal()
    tracker = ProgressTracker(200, start_step=50, stream=stream)
    assert tracker.active and tracker.completed == 50
    tracker.close()
    out = stream.getvalue()
    assert "50/200" in out and "0/200" not in out.replace("50/200", "")


def test_progress_bar_shows_step_loss_tok_s_and_an_eta_that_ignores_the_resumed_steps() -> None:
    stream = FakeTerminal()
    tracker = ProgressTracker(200, start_step=50, stream=stream)  # resumed at step 50, after 1000 s of training
    tracker.log("train", {**TRAIN_ROW, "step": 60, "elapsed_s": 1010.0, "tokens_per_s": 777.0})
    assert tracker.completed == 60 and tracker.eta_s is None
    tracker.log("train", {**TRAIN_ROW, "step": 70, "elapsed_s": 1020.0, "tokens_per_s": 888.0})
    # 10 steps per 10 s: 130 s left. The whole run's pace would say 130 x 1020/70 = 1894 s; the 70 steps taken as
    # this process's 20 s of work (the resumed ones done in no time) would say 130 x 20/70 = 37 s.
    assert tracker.completed == 70 and tracker.eta_s == pytest.approx(130.0)
    tracker.log("info", info("saved [bold]checkpoint[/bold] step-000070"))  # printed verbatim, not as rich markup
    tracker.close()
    out = stream.getvalue()
    assert "70/200" in out
    assert "loss 2.3141" in out and "888 tok/s" in out and "eta 0:02:10" in out
    assert "saved [bold]checkpoint[/bold] step-000070" in out


# ------------------------------------------------------------------------------------------- build_tracker


def test_null_tracker_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    tracker = NullTracker()
    tracker.log("train", TRAIN_ROW)
    tracker.log("eval", EVAL_ROW)
    tracker.log("info", info("hello"))
    tracker.close()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr() == ("", "")


def test_build_tracker_off_main_rank_is_null_and_writes_nothing(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    tracker = build_tracker(make_cfg(progress=True, tensorboard=True, wandb={"enabled": True}), run_dir,
                            is_main=False)
    assert isinstance(tracker, NullTracker)
    tracker.log("train", TRAIN_ROW)
    tracker.log("eval", EVAL_ROW)
    tracker.log("info", info("hello"))
    tracker.close()
    assert not run_dir.exists()
    assert capsys.readouterr() == ("", "")


def test_build_tracker_on_main_rank_writes_jsonl_train_log_and_stdout(tmp_path: Path, capsys) -> None:
    tracker = build_tracker(make_cfg(), tmp_path, is_main=True)
    tracker.log("train", TRAIN_ROW)
    tracker.log("eval", EVAL_ROW)
    tracker.log("info", info("done"))
    tracker.close()
    assert [row["kind"] for row in read_metrics(tmp_path)] == ["train", "eval"]
    line = "step 10/10 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120"
    assert log_lines(tmp_path) == [line, format_eval_line(EVAL_ROW), "done"]
    assert capsys.readouterr().out.splitlines() == [line, format_eval_line(EVAL_ROW), "done"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.jsonl", "train.log"]


GRPO_ROW = {**TRAIN_ROW, "reward": 0.4375, "reward_std": 0.31, "frac_zero_std": 0.25, "clip_fraction": 0.0}


@pytest.mark.parametrize("grpo,loss,line", [
    ({}, -3e-9, "step 10/10 | reward 0.4375 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120"),
    ({"loss": "token"}, 0.0123, "step 10/10 | reward 0.4375 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120"),
    ({"iterations": 2}, 0.0123, "step 10/10 | reward 0.4375 | loss 0.0123 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120"),
    ({"beta": 0.05}, 0.0123, "step 10/10 | reward 0.4375 | loss 0.0123 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120"),
], ids=["one_iteration", "token_loss", "iterations_2", "beta"])
def test_a_grpo_step_line_leads_with_the_reward_and_shows_the_loss_only_where_it_informs(
        tmp_path: Path, capsys, grpo: dict[str, object], loss: float, line: str) -> None:
    """GRPO: the reward follows the step; the loss follows it only with grpo.iterations > 1 or grpo.beta > 0 (one
    update per generation batch and no KL: its value is ~0 or a by-product, never a `loss -0.0000` to watch), in
    train.log and on the console alike; metrics.jsonl keeps the loss either way."""
    tracker = build_tracker(grpo_cfg(**grpo), tmp_path, is_main=True)
    tracker.log("train", {**GRPO_ROW, "loss": loss})
    tracker.close()
    assert log_lines(tmp_path) == [line]
    assert capsys.readouterr().out.splitlines() == [line]
    assert read_metrics(tmp_path)[0]["loss"] == loss


def test_the_grpo_progress_bar_shows_the_reward_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stdout = FakeTerminal()
    monkeypatch.setattr("sys.stdout", stdout)
    cfg = grpo_cfg()
    cfg.logging.progress = True
    tracker = build_tracker(cfg, tmp_path, is_main=True)
    tracker.log("train", {**GRPO_ROW, "loss": -3e-9})
    tracker.close()
    out = stdout.getvalue()
    assert "reward 0.4375" in out and "lr 3.00e-04" in out and "loss" not in out


def test_build_tracker_starts_the_bar_at_start_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stdout = FakeTerminal()
    monkeypatch.setattr("sys.stdout", stdout)
    tracker = build_tracker(make_cfg(max_steps=200, progress=True), tmp_path, is_main=True, start_step=120)
    assert isinstance(tracker, MultiTracker)
    progress = next(t for t in tracker.trackers if isinstance(t, ProgressTracker))
    assert progress.active and progress.completed == 120
    tracker.close()
    assert "120/200" in stdout.getvalue()


# -------------------------------------------------------------------------------------- wandb, tensorboard


def test_wandb_missing_is_one_line_and_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb is optional (a GPU image may lack it): a recipe that enables it gets one line, and no wandb folder or
    WANDB_* variable is left, so the run that trained nothing is removed whole (finetune.storage.unstarted)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of wandb fails
    for key in [key for key in os.environ if key.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        WandbTracker(make_cfg(wandb={"enabled": True}), run_dir)
    assert str(info.value) == NO_WANDB and "\n" not in NO_WANDB and "pip install wandb" in NO_WANDB
    assert not run_dir.exists() and not [key for key in os.environ if key.startswith("WANDB_")]


def test_wandb_offline_logs_and_reuses_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever the tracker sets
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    cfg = make_cfg(wandb={"enabled": True})

    tracker = build_tracker(cfg, run_dir, is_main=True)
    tracker.log("train", TRAIN_ROW)
    tracker.log("eval", EVAL_ROW)
    tracker.log("info", info("not sent"))
    tracker.close()
    run_id = (run_dir / rundir.WANDB_RUN_ID).read_text(encoding="utf-8").strip()
    assert run_id
    assert list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))

    resumed = build_tracker(cfg, run_dir, is_main=True, start_step=50)
    resumed.log("train", {**TRAIN_ROW, "step": 60})
    resumed.close()
    assert (run_dir / rundir.WANDB_RUN_ID).read_text(encoding="utf-8").strip() == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
    assert not home.exists()  # everything wandb wrote stayed in the run dir


def test_tensorboard_writes_an_events_file(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    tracker = build_tracker(make_cfg(tensorboard=True), tmp_path, is_main=True)
    tracker.log("train", TRAIN_ROW)
    tracker.log("eval", EVAL_ROW)
    tracker.log("info", info("not a scalar"))
    tracker.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
