"""finetune.objectives: the rules of each recipe ``task`` as data, consistent with the schema and the registry, and
the lines they give, checked against the sentences a user reads (written out here)."""

from __future__ import annotations

from typing import get_args

import pytest

from finetune import objectives, registry
from finetune.config.schema import RecipeConfig, data_formats


def test_every_task_the_schema_accepts_has_a_record() -> None:
    literal, none = get_args(RecipeConfig.model_fields["task"].annotation)  # Literal[...] | None
    assert none is type(None) and set(get_args(literal)) == set(objectives.OBJECTIVES)
    assert all(name == record.name for name, record in objectives.OBJECTIVES.items())


def test_owned_formats_and_the_tasks_that_need_them_agree() -> None:
    for fmt, owned in objectives.OWNED_FORMATS.items():
        assert fmt == owned.format and fmt in data_formats()
        assert {name for name, record in objectives.OBJECTIVES.items() if record.data == fmt} == set(owned.tasks)
        assert owned.metrics_of is None or owned.metrics_of in owned.tasks
    # a task that needs a format needs an owned one; every metric it names is a metric finetune computes
    known = set().union(*registry.TASK_METRICS.values(), *(r.metrics or () for r in objectives.OBJECTIVES.values()))
    for record in objectives.OBJECTIVES.values():
        assert record.data is None or record.data in objectives.OWNED_FORMATS
        assert record.metrics is None or record.metrics <= known


@pytest.mark.parametrize("task, dropout", [(None, True), ("sft", True), ("dpo", False), ("reward", False),
                                           ("grpo", False)])
def test_dropout_default(task: str | None, dropout: bool) -> None:
    assert objectives.dropout_default(task) is dropout


@pytest.mark.parametrize("task, fmt, packing, on_prompt, lines", [
    ("sft", "alpaca", True, True, []),
    ("dpo", "alpaca", False, False, ["task: dpo trains on preference pairs; set data.format=preference (got alpaca)"]),
    ("grpo", "chat", False, False, ["task: grpo generates from prompt rows; set data.format=prompt (got chat)"]),
    (None, "preference", True, True, [
        "data.format: preference pairs train task: dpo or task: reward; set task (now null)",
        "data.packing: preference pairs are not packed (each pair is one padded chosen/rejected batch); set "
        "data.packing=false",
        "data.train_on_prompt: preference pairs learn from their answers only; set it to false"]),
    ("reward", "preference", False, False, []),
    ("sft", "prompt", True, False, [
        "data.format: prompt rows train task: grpo; set task (now sft)",
        "data.packing: prompt rows are not packed (task grpo trains on generated completions); set "
        "data.packing=false"]),
    # a task that needs one owned format, given the other: its own line first, then the other format's lines
    ("grpo", "preference", False, True, [
        "data.format: preference pairs train task: dpo or task: reward; set task (now grpo)",
        "data.train_on_prompt: preference pairs learn from their answers only; set it to false",
        "task: grpo generates from prompt rows; set data.format=prompt (got preference)"]),
])
def test_data_lines(task: str | None, fmt: str, packing: bool, on_prompt: bool, lines: list[str]) -> None:
    assert objectives.data_lines(task, fmt, packing, on_prompt) == lines


@pytest.mark.parametrize("task, fmt, scored", [(None, "alpaca", None), ("sft", "chat", None), ("dpo", "preference",
                         "dpo"), ("reward", "preference", "reward"), (None, "preference", "dpo"), ("grpo", "prompt",
                         "grpo"), ("sft", "prompt", None)])
def test_metrics_task(task: str | None, fmt: str, scored: str | None) -> None:
    assert objectives.metrics_task(task, fmt) == scored


def test_every_task_a_recipe_or_a_row_names_has_an_adapter() -> None:
    from finetune.tasks import ADAPTERS  # imports torch

    recipe_tasks = {name for name, record in objectives.OBJECTIVES.items() if record.data is not None}  # not sft
    assert recipe_tasks | set(registry.TASK_METRICS) | {"reward"} == set(ADAPTERS)
