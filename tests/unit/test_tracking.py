"""Metric sinks: file formats, tok/s, rank and terminal gating, wandb offline resume, tensorboard."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from finetune import rundir
from finetune.config.schema import RecipeConfig
from finetune.errors import RunDirError
from finetune.tracking import (
    JsonlTracker,
    MultiTracker,
    NullTracker,
    ProgressTracker,
    TrainLogTracker,
    build_tracker,
    read_metrics,
)

TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} ")
TRAIN_ROW = {"step": 10, "loss": 2.31412, "lr": 3e-4, "grad_norm": 1.0212, "tokens": 51200, "elapsed_s": 10.0}
EVAL_ROW = {"step": 50, "eval_loss": 1.23449, "eval_ppl": 3.4364, "eval_exact_match": 0.8125,
            "eval_correct": 26, "eval_total": 32}


def make_cfg(**logging: object) -> RecipeConfig:
    """A minimal valid recipe, with the given logging section."""
    return RecipeConfig.model_validate({
        "name": "t",
        "model": {"type": "tiny-llama"},
        "data": {"format": "alpaca", "train": "x.jsonl"},
        "train": {"max_steps": 10, "micro_batch_size": 1, "global_batch_size": 1},
        "logging": {"progress": False, **logging},
    })


def log_lines(run_dir: Path) -> list[str]:
    """train.log without the timestamps (each line must carry one)."""
    lines = (run_dir / "train.log").read_text(encoding="utf-8").splitlines()
    assert all(TIMESTAMP.match(line) for line in lines), lines
    return [TIMESTAMP.sub("", line) for line in lines]


class FakeTerminal(io.StringIO):
    """A stream that claims to be a terminal, to exercise the live progress bar."""

    def isatty(self) -> bool:
        return True


def test_jsonl_rows_round_trip_with_kinds(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    tracker.log_train(TRAIN_ROW)
    tracker.info("not a metric")
    tracker.log_eval(EVAL_ROW)
    tracker.close()
    assert read_metrics(tmp_path) == [{"kind": "train", **TRAIN_ROW}, {"kind": "eval", **EVAL_ROW}]


def test_jsonl_is_flushed_per_row_and_appends(tmp_path: Path) -> None:
    first = JsonlTracker(tmp_path)
    first.log_train(TRAIN_ROW)
    assert len(read_metrics(tmp_path)) == 1  # readable before close
    first.close()
    second = JsonlTracker(tmp_path)  # a resumed run appends
    second.log_train({**TRAIN_ROW, "step": 20})
    second.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [10, 20]


def test_read_metrics_skips_truncated_last_line_and_rejects_missing(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "tr', encoding="utf-8")
    assert read_metrics(tmp_path) == [{"kind": "train", "step": 1}]
    with pytest.raises(RunDirError, match=r"metrics\.jsonl"):
        read_metrics(tmp_path / "nope")


def test_train_log_line_format(tmp_path: Path) -> None:
    tracker = TrainLogTracker(tmp_path, max_steps=200)
    tracker.log_train(TRAIN_ROW)
    tracker.log_train({**TRAIN_ROW, "step": 20, "tokens": 102400, "elapsed_s": 20.0, "loss_scale": 65536.0,
                       "skipped": 1})
    tracker.info("saved checkpoint step-000100")
    tracker.close()
    assert log_lines(tmp_path) == [
        "step 10/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120",
        "step 20/200 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120 | loss_scale 65536 | skipped (overflow)",
        "saved checkpoint step-000100",
    ]


def test_tok_per_s_is_computed_between_successive_rows(tmp_path: Path) -> None:
    tracker = TrainLogTracker(tmp_path, max_steps=None)
    tracker.log_train({**TRAIN_ROW, "tokens": 1000, "elapsed_s": 2.0})  # first row: 1000 / 2
    tracker.log_train({**TRAIN_ROW, "tokens": 4000, "elapsed_s": 3.0})  # (4000 - 1000) / (3 - 2)
    tracker.log_train({**TRAIN_ROW, "tokens": 5000, "elapsed_s": 7.0})  # (5000 - 4000) / (7 - 3)
    tracker.close()
    rates = [line.rsplit("tok/s ", 1)[1] for line in log_lines(tmp_path)]
    assert rates == ["500", "3000", "250"]
    assert log_lines(tmp_path)[0].startswith("step 10 | ")  # unknown length: no "/max_steps"


def test_eval_line_lists_metrics_with_correct_over_total(tmp_path: Path) -> None:
    tracker = TrainLogTracker(tmp_path, max_steps=200)
    tracker.log_eval(EVAL_ROW)
    tracker.log_eval({"step": 60, "eval_loss": 1.0, "eval_ppl": 2.72, "eval_exact_match": 0.5,
                      "eval_exact_match_correct": 16, "eval_exact_match_total": 32, "eval_token_accuracy": 0.75,
                      "eval_token_accuracy_correct": 300, "eval_token_accuracy_total": 400})
    tracker.close()
    assert log_lines(tmp_path) == [
        "eval step 50 | eval_loss 1.2345 | eval_ppl 3.44 | eval_exact_match 0.8125 (26/32)",
        "eval step 60 | eval_loss 1.0000 | eval_ppl 2.72 | eval_exact_match 0.5000 (16/32)"
        " | eval_token_accuracy 0.7500 (300/400)",
    ]


def test_null_tracker_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tracker = NullTracker()
    tracker.log_train(TRAIN_ROW)
    tracker.log_eval(EVAL_ROW)
    tracker.info("hello")
    tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_build_tracker_off_main_rank_is_null_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tracker = build_tracker(make_cfg(progress=True, tensorboard=True, wandb={"enabled": True}), run_dir,
                            is_main=False)
    assert isinstance(tracker, NullTracker)
    tracker.log_train(TRAIN_ROW)
    tracker.log_eval(EVAL_ROW)
    tracker.info("hello")
    tracker.close()
    assert not run_dir.exists()


def test_build_tracker_on_main_rank_writes_jsonl_and_train_log(tmp_path: Path) -> None:
    tracker = build_tracker(make_cfg(), tmp_path, is_main=True)
    tracker.log_train(TRAIN_ROW)
    tracker.log_eval(EVAL_ROW)
    tracker.info("done")
    tracker.close()
    assert [row["kind"] for row in read_metrics(tmp_path)] == ["train", "eval"]
    assert log_lines(tmp_path)[0] == "step 10/10 | loss 2.3141 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.jsonl", "train.log"]


def test_progress_is_a_no_op_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()  # isatty() is False, as for a pipe or a log file
    monkeypatch.setattr("sys.stderr", stream)
    tracker = ProgressTracker(200, start_step=0)
    assert not tracker.active
    tracker.log_train(TRAIN_ROW)
    tracker.info("hello")
    tracker.close()
    assert stream.getvalue() == ""
    assert not ProgressTracker(200, enabled=False, stream=FakeTerminal()).active


def test_progress_on_a_terminal_shows_step_loss_and_events() -> None:
    stream = FakeTerminal()
    tracker = ProgressTracker(200, start_step=50, stream=stream)  # a resumed run starts mid-way
    assert tracker.active
    tracker.log_train({**TRAIN_ROW, "step": 60})
    tracker.info("saved [bold]checkpoint[/bold] step-000060")  # printed verbatim, not as rich markup
    tracker.close()
    out = stream.getvalue()
    assert "60/200" in out
    assert "loss 2.3141" in out
    assert "saved [bold]checkpoint[/bold] step-000060" in out


def test_multi_tracker_closes_all_even_if_one_raises(tmp_path: Path) -> None:
    class Broken(NullTracker):
        def close(self) -> None:
            raise RuntimeError("boom")

    jsonl = JsonlTracker(tmp_path)
    tracker = MultiTracker([Broken(), jsonl])
    tracker.log_train(TRAIN_ROW)
    with pytest.raises(RuntimeError, match="boom"):
        tracker.close()
    with pytest.raises(ValueError, match="closed"):
        jsonl.log_train(TRAIN_ROW)


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
    tracker.log_train(TRAIN_ROW)
    tracker.log_eval(EVAL_ROW)
    tracker.close()
    run_id = (run_dir / rundir.WANDB_RUN_ID).read_text(encoding="utf-8").strip()
    assert run_id
    assert list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))

    resumed = build_tracker(cfg, run_dir, is_main=True, start_step=50)
    resumed.log_train({**TRAIN_ROW, "step": 60})
    resumed.close()
    assert (run_dir / rundir.WANDB_RUN_ID).read_text(encoding="utf-8").strip() == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
    assert not home.exists()  # everything wandb wrote stayed in the run dir


def test_tensorboard_writes_an_events_file(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    tracker = build_tracker(make_cfg(tensorboard=True), tmp_path, is_main=True)
    tracker.log_train(TRAIN_ROW)
    tracker.log_eval(EVAL_ROW)
    tracker.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_eval_line_with_samples_and_two_metrics_shows_each_count_once() -> None:
    from finetune.tracking import format_eval_line

    row = {"step": 100, "eval_loss": 0.5, "eval_ppl": 1.65, "eval_samples": 200,
           "eval_exact_match": 0.81, "eval_exact_match_correct": 162, "eval_exact_match_total": 200,
           "eval_token_accuracy": 0.95, "eval_token_accuracy_correct": 948, "eval_token_accuracy_total": 991,
           "eval_correct": 162, "eval_total": 200}
    line = format_eval_line(row)
    assert line == ("eval step 100 | eval_loss 0.5000 | eval_ppl 1.65 | samples 200 | eval_exact_match 0.8100 "
                    "(162/200) | eval_token_accuracy 0.9500 (948/991)")
