"""finetune.storage.metrics: reading metrics.jsonl back (a torn last row skipped, a bad row or a file that is not a
regular file refused in one line), the metric lines ``finetune eval`` prints, and the headline a run's lines lead with.
The trackers that write the file are test_tracking.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from finetune import objectives
from finetune.errors import RunDirError
from finetune.storage import rundir
from finetune.storage.metrics import format_metrics, headline, read_metrics, recipe_headline


def test_read_metrics_skips_truncated_last_line_and_rejects_missing(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "tr', encoding="utf-8")
    assert read_metrics(tmp_path) == [{"kind": "train", "step": 1}]
    with pytest.raises(RunDirError, match=r"metrics\.jsonl"):
        read_metrics(tmp_path / "nope")


ROW = '{"kind": "train", "step": 1}'


@pytest.mark.parametrize("bad,why", [
    ('{"kind": "end", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep"),
    ('{"kind": "end", "samples": ' + "9" * 5000 + "}", "a number with too many digits"),
    ("[1, 2]", "a JSON list"),
    ('"end"', "a JSON str"),
], ids=["nested-100000-deep", "5000-digits", "a-list", "a-string"])
def test_a_bad_row_is_one_line_naming_it_and_a_torn_last_one_is_skipped(tmp_path: Path, bad: str, why: str) -> None:
    """Rows no tracker writes (a row nested 100,000 deep, which makes the JSON parser raise RecursionError; a number
    Python will not convert; JSON that is not an object) are a RunDirError naming the file and the line, not an
    internal error; as the last line they are skipped like a row torn by a kill."""
    (tmp_path / rundir.METRICS).write_text(f"{ROW}\n{bad}\n{ROW}\n", encoding="utf-8")
    with pytest.raises(RunDirError, match=re.escape(f"metrics.jsonl:2: not a JSON object ({why})")):
        read_metrics(tmp_path)
    (tmp_path / rundir.METRICS).write_text(f"{ROW}\n{bad}\n", encoding="utf-8")
    assert read_metrics(tmp_path) == [json.loads(ROW)]


def _plant(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-to-a-file":
        (path.parent / "elsewhere.jsonl").write_text(ROW + "\n")
        path.symlink_to(path.parent / "elsewhere.jsonl")
    else:
        path.mkdir()


@pytest.mark.parametrize("kind,what", [("fifo", "a FIFO, socket or device"), ("link-to-dev-zero", "a symbolic link"),
                                       ("link-to-a-file", "a symbolic link"), ("folder", "a folder")])
def test_metrics_that_are_not_a_regular_file_are_said_to_be_so(tmp_path: Path, kind: str, what: str) -> None:
    """A FIFO, a link (to /dev/zero, which never ends, or to any file) or a folder as metrics.jsonl is refused in
    one line that says what it is, without blocking or reading through the link; only a missing file is "not
    found"."""
    _plant(tmp_path / rundir.METRICS, kind)
    with pytest.raises(RunDirError, match=re.escape(f"metrics.jsonl: not a regular file ({what})")):
        read_metrics(tmp_path)


def test_format_metrics_prints_each_metric_once_with_its_counts() -> None:
    metrics = {"step": 100, "eval_loss": 0.5, "eval_ppl": 1.6487, "eval_samples": 200,
               "eval_exact_match": 0.99, "eval_exact_match_correct": 198, "eval_exact_match_total": 200,
               "eval_token_accuracy": 0.95, "eval_token_accuracy_correct": 948, "eval_token_accuracy_total": 998,
               "eval_correct": 198, "eval_total": 200, "target": "runs/x/final"}
    assert format_metrics(metrics) == [
        "step = 100",
        "eval_loss = 0.5000",
        "eval_ppl = 1.6487",
        "eval_samples = 200",
        "eval_exact_match 198/200 = 0.9900",
        "eval_token_accuracy 948/998 = 0.9500",
        "target = runs/x/final",
    ]


def test_format_metrics_gives_the_generic_counts_to_a_lone_metric_and_else_keeps_them() -> None:
    lone = {"eval_loss": 0.5, "eval_accuracy": 0.75, "eval_correct": 3, "eval_total": 4}
    assert format_metrics(lone) == ["eval_loss = 0.5000", "eval_accuracy 3/4 = 0.7500"]
    two = {"eval_a": 0.5, "eval_b": 0.25, "eval_correct": 2, "eval_total": 4}  # counts of neither shown metric
    assert format_metrics(two) == ["eval_a = 0.5000", "eval_b = 0.2500", "eval_correct = 2", "eval_total = 4"]
    assert format_metrics({"eval_loss": 0.5, "eval_ppl": 1.65}) == ["eval_loss = 0.5000", "eval_ppl = 1.6500"]


def test_the_headline_is_the_loss_for_every_task_but_grpo() -> None:
    """The rule the step lines, the summary and the plot share, from a recipe as validated or as plain data (a
    malformed grpo section counts as its defaults)."""
    for task in (None, "sft", "dpo", "reward"):
        assert headline(task).train == ("loss",) and headline(task).eval == ()
        assert recipe_headline({"task": task, "grpo": {"iterations": 3, "beta": 0.5}}).train == ("loss",)
    assert headline("grpo", 1, 0.0).train == ("reward",) and not headline("grpo").loss
    assert headline("grpo", 2, 0.0).train == headline("grpo", 1, 0.01).train == ("reward", "loss")
    assert headline("grpo").eval == ("eval_exact_match", "eval_reward")
    assert recipe_headline({"task": "grpo", "grpo": "nonsense"}).train == ("reward",)
    assert recipe_headline({"task": "grpo", "grpo": {"iterations": "2", "beta": True}}).train == ("reward",)
    assert recipe_headline({"task": "grpo", "grpo": {"beta": 0.1}}).loss
    # the plot's first panels are the task record's: none of its own for every task but GRPO
    assert all(headline(task).panels == () for task in (None, "sft", "dpo", "reward"))
    assert headline("grpo").panels == objectives.OBJECTIVES["grpo"].panels and "reward" in headline("grpo").panels
