"""The GRPO quickstart learns from rewards alone, as docs/tasks/grpo.md runs it (checkpoints off, eval at the start
and end).

A short SFT of the reverse-letters quickstart (180 steps at a constant learning rate) leaves the model partly right
on the held-out prompts; GRPO with only the exact_match reward, on other prompts of the task and never an answer's
text as a target, must raise the held-out exact match well above that start. A file of its own, so that a parallel
run (pytest-xdist, one file per worker) does not queue it behind the other quickstart tests."""

from __future__ import annotations

import pytest

from tests.integration.test_quickstarts import run_quickstart

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_grpo_raises_held_out_exact_match_above_where_sft_left_it(tmp_path) -> None:
    sft = run_quickstart("quickstart.yaml", tmp_path, "train.max_steps=180", "scheduler.name=constant",
                         "eval.at_start=false", "eval.every_steps=null", run="sft")
    grpo = run_quickstart("grpo-quickstart.yaml", tmp_path, f"model.path={tmp_path / 'sft' / 'final'}",
                          "eval.every_steps=null", run="grpo")
    before, after = grpo[0], grpo[-1]
    assert before["step"] == 0 and after["step"] == 40 and after["eval_exact_match_total"] == 200
    # the GRPO run's first eval is the SFT model's: the same 200 greedy completions
    assert before["eval_exact_match_correct"] == sft[-1]["eval_exact_match_correct"]
    # partly right: something to reinforce, much left to learn (27/200 measured)
    assert 5 <= before["eval_exact_match_correct"] <= 100
    # rewards alone raise it well above the start (27/200 -> 49/200 measured at step 40)
    assert after["eval_exact_match_correct"] >= before["eval_exact_match_correct"] + 12
    assert after["eval_exact_match_correct"] >= 1.4 * before["eval_exact_match_correct"]
