"""finetune.commands.train's recipe for `finetune plan`: a global batch the asked processes cannot split is planned
at the next one they can, with a note saying so (per-rank memory depends on the micro-batch), where `finetune run`
refuses it in one line."""

from __future__ import annotations

import pytest

from finetune.commands.train import splittable_batch
from tests.cli_helpers import assert_user_error, main_exit


@pytest.mark.parametrize("recipe,planned", [
    ({"train": {"global_batch_size": 32, "micro_batch_size": 32}, "launch": {"num_processes": 8}}, 256),
    ({"train": {"global_batch_size": 30, "micro_batch_size": 4}, "launch": {"num_processes": 2}}, 32),
    ({"train": {"global_batch_size": 12}, "launch": {"num_processes": 8}}, 64),  # micro_batch_size: its default 8
    ({"train": {"global_batch_size": 32, "micro_batch_size": 4}, "launch": {"num_processes": 8}}, None),  # splits
    ({"train": {"global_batch_size": 32, "micro_batch_size": 8}}, None),  # one process: 32 = 8 x 4
    ({"train": {"global_batch_size": "32", "micro_batch_size": 5}}, None),  # not a number: validation names it
    ({"train": {"global_batch_size": 30, "micro_batch_size": 0}}, None),  # not positive: validation names it
])
def test_the_planned_global_batch_is_the_next_the_processes_can_split(recipe: dict, planned: int | None) -> None:
    found = splittable_batch(recipe)
    assert (found[0] if found else None) == planned
    if found:
        assert found[1].startswith(f"planned with train.global_batch_size={planned}: ")
        assert "a run refuses it" in found[1]


def test_plan_answers_for_8_ranks_where_run_refuses_the_batch(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("quickstart", "train.global_batch_size=32", "train.micro_batch_size=32", "--accelerate-config", "zero3",
             "--num-processes", "8")
    code, out, err = main_exit(monkeypatch, capsys, "plan", *flags)
    assert code == 0 and "Traceback" not in err, err
    assert "note: planned with train.global_batch_size=256: train.global_batch_size=32 is not a multiple" in out
    assert_user_error(*main_exit(monkeypatch, capsys, "run", *flags, "--dry-run"),
                      "train.global_batch_size=32 is not a multiple")
