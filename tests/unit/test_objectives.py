"""finetune.objectives: the rules of each recipe ``task`` as data, consistent with the schema and the registry, and
the lines they give, checked against the sentences a user reads (written out here)."""

from __future__ import annotations

import ast
from pathlib import Path
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
        # the tasks that need the format read it; a task may read it besides its own rows (distill's prompt rows)
        assert {name for name, record in objectives.OBJECTIVES.items() if record.data == fmt} <= set(owned.tasks)
        assert set(owned.tasks) <= set(objectives.OBJECTIVES)
        assert owned.metrics_of is None or owned.metrics_of in owned.tasks
    # a task that needs a format needs an owned one; every metric it names is a metric finetune computes
    known = set().union(*registry.TASK_METRICS.values(), *(r.metrics or () for r in objectives.OBJECTIVES.values()))
    for record in objectives.OBJECTIVES.values():
        assert record.data is None or record.data in objectives.OWNED_FORMATS
        # a task reads prompt rows exactly when its record names the section of their completions' room
        assert (record.name in objectives.OWNED_FORMATS["prompt"].tasks) == (record.prompt_section is not None)
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
        "data.format: prompt rows train task: grpo or task: distill; set task (now sft)",
        "data.packing: prompt rows are not packed (their tasks train on generated completions); set "
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

    recipe_tasks = {name for name in objectives.OBJECTIVES if name != "sft"}  # sft trains the row's own task
    assert recipe_tasks | set(registry.TASK_METRICS) | {"reward"} == set(ADAPTERS)


# Each recipe task's rules, written out: (row_tasks, row_capability, builds, generates, rewards, repeats_batches,
# groups, reference, reference_copy, headline, collapse, panels)
CAUSAL = frozenset({"causal_lm", "vision_causal_lm"})
GRPO_HEADLINE = (("reward", "loss"), ("eval_exact_match", "eval_reward"))
GRPO_PANELS = ("reward", "eval_exact_match", "eval_reward", "reward_*", "completion_len", "kl", "loss", "lr",
               "grad_norm")
RECORDS = {
    "sft": (CAUSAL, None, None, False, False, False, False, "never", False, None, "row", None),
    "dpo": (None, "preference", None, False, False, False, False, "always", False, None, "unknown", None),
    "reward": (None, "preference", "reward", False, False, False, False, "never", False, None, "pairs", None),
    "grpo": (frozenset({"causal_lm"}), "generation", None, True, True, True, True, "beta", True, GRPO_HEADLINE,
             "never", GRPO_PANELS),
}


@pytest.mark.parametrize("task", sorted(RECORDS))
def test_each_record_says_what_its_task_runs(task: str) -> None:
    r = objectives.OBJECTIVES[task]
    assert (r.row_tasks, r.row_capability, r.builds, r.generates, r.rewards, r.repeats_batches, r.groups,
            r.reference, r.reference_copy, r.headline, r.collapse, r.panels) == RECORDS[task]


# Each model row task's rules, written out: (metrics, formats, causal, text_causal, vision, labels, scores)
ROWS = {
    "causal_lm": ({"token_accuracy", "exact_match", "tool_calls"}, {"alpaca", "chat", "completion"}, True, True, False,
                  False, False),
    "vision_causal_lm": ({"token_accuracy", "exact_match"}, {"vision_chat"}, True, False, True, False, False),
    "classification": ({"accuracy"}, {"classification"}, False, False, False, True, False),
    "reward": (None, set(), False, False, False, False, True),
}


@pytest.mark.parametrize("task", sorted(ROWS))
def test_each_row_task_record(task: str) -> None:
    r = registry.ROW_TASKS[task]  # type: ignore[index]
    assert (r.metrics, r.formats, r.causal, r.text_causal, r.vision, r.labels, r.scores) == ROWS[task]


def test_the_row_tables_are_read_from_the_row_records() -> None:
    assert {"causal_lm", "vision_causal_lm"} == registry.CAUSAL_TASKS
    assert set(registry.TASK_METRICS) == set(registry.TASK_FORMATS) == {"causal_lm", "vision_causal_lm",
                                                                         "classification"}  # reward: never a row's own
    assert registry.TASK_FORMATS["classification"] == {"classification"}


@pytest.mark.parametrize("task, beta, needed", [(None, 0.5, False), ("sft", 0.5, False), ("reward", 0.5, False),
                                                ("dpo", 0.0, True), ("grpo", 0.0, False), ("grpo", 0.04, True)])
def test_needs_reference(task: str | None, beta: float, needed: bool) -> None:
    class Grpo:
        pass

    class Recipe:
        grpo = Grpo()

    Recipe.grpo.beta = beta  # type: ignore[attr-defined]
    assert objectives.needs_reference(task, Recipe()) is needed


def test_needs_reference_reads_grpo_only_where_beta_decides() -> None:
    class NoGrpo:
        pass  # a recipe without a grpo section: dpo and sft must not ask for one

    assert objectives.needs_reference("dpo", NoGrpo()) is True
    assert objectives.needs_reference("sft", NoGrpo()) is False


GEN = frozenset({"generation", "preference"})


@pytest.mark.parametrize("task, row_task, caps, line", [
    (None, "classification", frozenset(), None),
    ("sft", "causal_lm", frozenset(), None),
    ("sft", "vision_causal_lm", frozenset(), None),
    ("sft", "classification", frozenset(), "task: sft trains causal LMs, but m is a classification model; use task: "
                                           "null"),
    ("dpo", "causal_lm", GEN, None),
    ("dpo", "classification", frozenset(), "task: m (classification) cannot train task dpo: it lacks the preference "
                                           "capability; use a causal LM model type (finetune models)"),
    ("reward", "causal_lm", frozenset({"generation"}), "task: m (causal_lm) cannot train task reward: it lacks the "
                                                      "preference capability; use a causal LM model type (finetune "
                                                      "models)"),
    ("grpo", "causal_lm", GEN, None),
    ("grpo", "causal_lm", frozenset({"preference"}), "task: grpo trains a causal LM on its own generated text, but m "
                                                     "is a causal_lm model without the generation capability; use a "
                                                     "causal LM model type that generates (finetune models)"),
    ("grpo", "vision_causal_lm", GEN, "task: grpo trains a causal LM on its own generated text, but m is a "
                                      "vision_causal_lm model; use a causal LM model type that generates (finetune "
                                      "models)"),
])
def test_row_line(task: str | None, row_task: str, caps: frozenset[str], line: str | None) -> None:
    assert objectives.row_line(task, "m", row_task, caps) == line


def test_objective_of_a_value_that_is_not_a_task() -> None:
    assert objectives.objective(["grpo"]) is None and objectives.objective(None) is None  # a recipe read as data
    assert objectives.objective("grpo") is objectives.OBJECTIVES["grpo"]


# Where a task's name may still be compared: its record (objectives.py) and its own module (finetune/tasks/).
PACKAGE = Path(__file__).resolve().parents[2] / "finetune"
TASK_NAMES = {"task", "row_task", "objective"}  # the names a task is held under (and any ``<x>.task``)
RULES_LIVE_IN = ("objectives.py", "tasks/")


def _task_name_tests(source: str) -> list[int]:
    """The lines of ``source`` that compare a task (a name in :data:`TASK_NAMES`, or an attribute ``.task``) with
    a string literal, or a collection of them (``==``, ``!=``, ``in``, ``not in``)."""
    def is_task(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id in TASK_NAMES) or \
            (isinstance(node, ast.Attribute) and node.attr == "task")

    def is_literal(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(is_literal(e) for e in node.elts)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn)
                                                 for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(is_task(s) for s in sides) and any(is_literal(s) for s in sides):
                found.append(node.lineno)
    return found


def test_the_scan_finds_a_task_name_test() -> None:
    assert _task_name_tests('if cfg.task == "grpo":\n    pass\nx = row.task in ("a", "b")\ny = "dpo" != task\n'
                            'z = task in OBJECTIVES\nw = fmt == "classification"\n') == [1, 3, 4]


def test_no_module_compares_a_task_with_its_name() -> None:
    """Every rule of a task is a field of its record (finetune.objectives, finetune.registry.ROW_TASKS) that the
    code asks; comparing a task with a name would make adding a task a hunt through the package again."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where.startswith(RULES_LIVE_IN):
            continue
        offenders += [f"finetune/{where}:{line}" for line in _task_name_tests(path.read_text())]
    assert offenders == []
