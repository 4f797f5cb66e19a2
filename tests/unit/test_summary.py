"""finetune.storage.summary: a finished run's summary read back from the files it wrote (rows written here as the
tracker writes them); which commands it suggests, and that a resume (which drops the end row) makes the run
unfinished."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from finetune.storage import rundir
from finetune.storage.metrics import truncate_metrics
from finetune.storage.summary import read_summary, render
from tests.recipe_files import write_recipe_file


def make_run(folder: Path, recipe: dict[str, Any], rows: list[dict[str, Any]], *, final: bool = True) -> Path:
    rundir.create(folder, overwrite=False).release()
    write_recipe_file(folder / rundir.RESOLVED, recipe)
    (folder / rundir.METRICS).write_text("".join(json.dumps(row) + "\n" for row in rows))
    if final:
        (folder / rundir.FINAL).mkdir()
        (folder / rundir.FINAL / rundir.MANIFEST).write_text("{}")
    return folder


TRAIN = [{"kind": "train", "step": 1, "loss": 2.5}, {"kind": "train", "step": 2, "loss": 1.25}]
EVAL = {"kind": "eval", "step": 2, "eval_loss": 1.5, "eval_samples": 40, "eval_accuracy": 0.75,
        "eval_accuracy_correct": 30, "eval_accuracy_total": 40, "eval_correct": 30, "eval_total": 40}
END = {"kind": "end", "step": 2, "samples": 16, "tokens": 1234, "train_s": 3.25, "wall_s": 75.0}


pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def test_a_lora_run_summary_has_its_numbers_paths_and_the_merge_command(tmp_path: Path) -> None:
    recipe = {"model": {"type": "tiny-llama"}, "task": None, "peft": {"method": "lora"}}
    run = make_run(tmp_path / "runs" / "lora", recipe, [*TRAIN, EVAL, END])
    summary = read_summary(run)
    assert summary is not None
    assert render(summary) == [
        "run runs/lora finished: 2 steps, 16 samples, 1,234 target tokens; training 3.2 s, wall 1 min 15 s",
        "  final train loss: 1.2500 (step 2)",
        "  final eval (step 2):",
        "    eval_loss = 1.5000",
        "    eval_samples = 40",
        "    eval_accuracy 30/40 = 0.7500",
        "  model:   runs/lora/final",
        "  logs:    runs/lora/train.log, runs/lora/metrics.jsonl",
        "  next:",
        "    finetune eval runs/lora",
        "    finetune generate runs/lora prompts.jsonl -o runs/lora-completions.jsonl",
        "    finetune merge runs/lora -o runs/lora-merged",
    ]


def test_a_classifier_generates_nothing_and_a_run_without_final_says_how_to_export(tmp_path: Path) -> None:
    recipe = {"model": {"type": "bert"}, "peft": {"method": "none"}}
    run = make_run(tmp_path / "cls", recipe, [*TRAIN, END], final=False)
    lines = render(read_summary(run))  # type: ignore[arg-type]
    assert "  final eval: none (no data.eval)" in lines
    assert "  model:   no final/ (checkpoint.save_final: false); `finetune export cls -o DIR` writes one from a " \
           "checkpoint" in lines
    assert not any(line.strip().startswith(("finetune generate", "finetune merge", "next")) for line in lines)


def test_only_a_finished_run_has_a_summary_and_a_resume_unfinishes_it(tmp_path: Path) -> None:
    recipe = {"model": {"type": "tiny-llama"}, "peft": {"method": "none"}}
    assert read_summary(make_run(tmp_path / "going", recipe, TRAIN)) is None  # still training (or killed)
    assert read_summary(tmp_path / "nothing") is None
    run = make_run(tmp_path / "done", recipe, [*TRAIN, EVAL, END])
    assert read_summary(run) is not None
    assert truncate_metrics(run, 2) == 1  # a resume from its last checkpoint: the end row goes
    assert read_summary(run) is None
    assert [row["kind"] for row in map(json.loads, (run / rundir.METRICS).read_text().splitlines())] == \
        ["train", "train", "eval"]


GRPO_TRAIN = [{"kind": "train", "step": 1, "loss": 2e-9, "reward": 0.25, "reward_std": 0.4},
              {"kind": "train", "step": 2, "loss": -3e-9, "reward": 0.4375, "reward_std": 0.3}]
GRPO_EVAL = {"kind": "eval", "step": 2, "eval_samples": 40, "eval_exact_match": 0.75, "eval_exact_match_correct": 30,
             "eval_exact_match_total": 40, "eval_correct": 30, "eval_total": 40, "eval_reward": 0.8125}


@pytest.mark.parametrize("grpo,train", [
    ({"iterations": 1, "beta": 0.0}, ["  final train reward: 0.4375 (step 2)"]),
    ({"iterations": 2, "beta": 0.0}, ["  final train reward: 0.4375 (step 2)", "  final train loss: -0.0000 (step 2)"]),
    ({"beta": 0.05}, ["  final train reward: 0.4375 (step 2)", "  final train loss: -0.0000 (step 2)"]),
], ids=["one_iteration", "iterations_2", "beta"])
def test_a_grpo_summary_leads_with_the_reward_and_the_eval_exact_match(tmp_path: Path, grpo: dict[str, Any],
                                                                       train: list[str]) -> None:
    """GRPO: the final train reward first, the loss only where its value carries information (grpo.iterations > 1
    or grpo.beta > 0), and the final eval's exact match and mean reward before its sample count."""
    recipe = {"model": {"type": "tiny-llama"}, "task": "grpo", "peft": {"method": "none"},
              "grpo": {"group_size": 8, **grpo}}
    run = make_run(tmp_path / "runs" / "grpo", recipe, [*GRPO_TRAIN, GRPO_EVAL, END])
    expected = [
        "run runs/grpo finished: 2 steps, 16 samples, 1,234 target tokens; training 3.2 s, wall 1 min 15 s",
        *train,
        "  final eval (step 2):",
        "    eval_exact_match 30/40 = 0.7500",
        "    eval_reward = 0.8125",
        "    eval_samples = 40",
        "  model:   runs/grpo/final",
    ]
    assert render(read_summary(run))[:len(expected)] == expected  # type: ignore[arg-type]


FORGED_END = {  # an end row, and the first line of the summary it gives
    "nan": ({"kind": "end", "step": math.nan, "samples": math.nan, "tokens": 2, "train_s": math.nan, "wall_s": 1.0},
            "? steps, ? samples, 2 target tokens; training ?, wall 1.0 s"),
    "1e400": ({"kind": "end", "step": math.inf, "samples": -math.inf, "tokens": math.inf, "train_s": math.inf,
               "wall_s": -1.0}, "? steps, ? samples, ? target tokens; training ?, wall ?"),
    "text": ({"kind": "end", "step": "2\nerror: a line of the row's", "samples": [16], "tokens": {"n": 1},
              "train_s": "3 s", "wall_s": None}, "? steps, ? samples, ? target tokens; training ?, wall ?"),
}


@pytest.mark.parametrize("forged", sorted(FORGED_END))
def test_a_forged_end_row_shows_question_marks_in_the_summary_s_own_lines(tmp_path: Path, forged: str) -> None:
    """An end row whose values are not counts and durations (NaN, what 1e400 reads as, negative, text with a line
    break, lists, objects) becomes "?" in the summary, and what is not a number in the train and eval rows is left
    out: the summary is its own lines, never a traceback (NaN and infinity raised ValueError / OverflowError
    there) and never a line a metrics row made up."""
    recipe = {"model": {"type": "tiny-llama"}, "peft": {"method": "none"}}
    train = {"kind": "train", "step": 2, "loss": 1.25, "note": "x\nerror: made up"}
    evals = {"kind": "eval", "step": "2\nerror: made up", "eval_loss": 1.5, "eval_x": "1\nerror: made up"}
    end, first = FORGED_END[forged]
    run = make_run(tmp_path / "runs" / "forged", recipe, [train, evals, end], final=False)
    lines = render(read_summary(run))  # type: ignore[arg-type]
    assert lines[:4] == [f"run runs/forged finished: {first}", "  final train loss: 1.2500 (step 2)",
                         "  final eval (step ?):", "    eval_loss = 1.5000"]
    assert not any("made up" in line or "\n" in line for line in lines), lines


def test_a_row_nested_100000_deep_leaves_the_run_without_a_summary(tmp_path: Path) -> None:
    """A metrics row nested 100,000 deep (json's parser raises RecursionError) is a bad row, so the run has no
    summary (finetune ls lists its checkpoints all the same), instead of an internal error."""
    recipe = {"model": {"type": "tiny-llama"}, "peft": {"method": "none"}}
    run = make_run(tmp_path / "deep", recipe, [*TRAIN, END], final=False)
    rows = (run / rundir.METRICS).read_text()
    (run / rundir.METRICS).write_text(rows + '{"kind": "end", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n" + rows)
    assert read_summary(run) is None
