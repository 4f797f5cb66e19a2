"""The VLM quickstart learns what the docs promise (see test_quickstarts.py; a file of its own so that a
parallel run gives it a worker of its own)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import REPO, cli_exit_code
from tests.integration.test_quickstarts import run_quickstart

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_vlm_quickstart_exact_match_from_below_the_majority_baseline_to_at_least_0_9(tmp_path) -> None:
    """The shapes questions need the image: a model that ignores it is at best at the majority baseline (the most
    frequent answer of each question), which the held-out eval starts below and ends far above."""
    import collections
    import json

    rows = [json.loads(line) for line in (REPO / "recipes/data/shapes/eval.jsonl").read_text().splitlines()]
    answers = collections.defaultdict(collections.Counter)
    for row in rows:
        answers[row["messages"][0]["content"][1]["text"]][row["messages"][-1]["content"]] += 1
    majority = sum(max(c.values()) for c in answers.values()) / len(rows)
    assert majority < 0.4
    evals = run_quickstart("vlm-quickstart.yaml", tmp_path)
    assert evals[0]["step"] == 0 and evals[0]["eval_exact_match"] <= majority
    assert evals[-1]["eval_exact_match"] >= 0.9 and evals[-1]["eval_total"] == len(rows) == 96
    # `finetune generate` with the same questions and images writes the answers the last eval scored
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as handle:
        for row in rows:
            question = row["messages"][0]["content"]
            question[0]["image"] = str(REPO / "recipes/data/shapes" / question[0]["image"])
            handle.write(json.dumps({"messages": row["messages"][:1], "answer": row["messages"][-1]["content"]}) + "\n")
    assert cli_exit_code("generate", str(tmp_path / "run"), str(prompts), "-o", str(tmp_path / "out.jsonl"),
                         "--max-new-tokens", "8", "--batch-size", "32") == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    right = sum(" ".join(r["completion"].split()) == " ".join(r["answer"].split()) for r in out)
    assert right == evals[-1]["eval_exact_match_correct"] >= 0.9 * len(rows)
