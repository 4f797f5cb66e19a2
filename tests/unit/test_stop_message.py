"""A run stopped by a signal says so once: rank 0's exit prints the stop line (the worker's log row is for
train.log only), and every other rank of a launched run exits with the same code in silence."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from finetune.errors import Interrupted
from finetune.runtime import worker
from finetune.runtime.tracking import ProgressTracker

STOP = "stopped by signal after step 2; checkpoint step-000002 saved; continue with `finetune resume runs/x`"


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


def test_a_log_only_event_is_not_printed() -> None:
    out, err = io.StringIO(), io.StringIO()
    console = ProgressTracker(4, bar=False, stream=out, warn_stream=err)
    console.log("info", {"message": STOP, "console": False})
    console.log("info", {"message": "saved checkpoint step-000002"})
    assert out.getvalue() == "saved checkpoint step-000002\n" and err.getvalue() == ""
