"""The training objectives a recipe's ``task`` key names, and the data formats that belong to one, as data.

Why a table: the rules of a task (which data it trains on, which eval metrics it reports, whether dropout stays on,
whether its data may stream, be packed or train on prompts) were ``cfg.task == ...`` tests spread over the schema,
the validator and the registry. Each is now a field of the task's record here, and those modules ask the record;
adding a task means its module in ``finetune/tasks/`` and its row here (docs/architecture.md says how). Torch-free
and import-light: the schema and the CLI read it.

``task: null`` trains the model row's own task (``causal_lm``, ``vision_causal_lm``, ``classification``): its rules
are the row's (``finetune.registry.TASK_METRICS`` and ``TASK_FORMATS``); :data:`OBJECTIVES` holds the tasks a recipe
names. :data:`OWNED_FORMATS` holds the data formats only some tasks train on (preference pairs, prompt rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Objective:
    """One value of the recipe's ``task`` key.

    ``metrics``: the ``eval.metrics`` it reports (None: the model row's own); ``data``: the data format it trains on
    (None: the row's formats) and ``data_need``: how its one line says so (``task: X {data_need}; set
    data.format=...``); ``row_tasks``: the model rows' tasks it trains (and ``row_capability``, one capability those
    rows must have); ``dropout``: what ``train.dropout: null`` means for it (off where the loss compares scores
    made without dropout); ``no_streaming``: why it cannot train on ``data.streaming`` (None: it can)."""

    name: str
    metrics: frozenset[str] | None
    data: str | None
    data_need: str
    dropout: bool
    no_streaming: str | None


@dataclass(frozen=True)
class OwnedFormat:
    """A data format that only ``tasks`` train on: ``noun`` names its rows in the lines; ``unpacked`` says why its
    rows are never packed; ``answer_only`` why ``data.train_on_prompt`` is refused for it; ``metrics_of``: the task
    whose ``eval.metrics`` a recipe with this format and another task is checked against (None: the model row's)."""

    format: str
    noun: str
    tasks: tuple[str, ...]
    unpacked: str
    answer_only: str
    metrics_of: str | None


OBJECTIVES: Mapping[str, Objective] = {
    "sft": Objective("sft", metrics=None, data=None, data_need="", dropout=True, no_streaming=None),
    "dpo": Objective("dpo", metrics=frozenset({"preference_accuracy"}), data="preference",
                     data_need="trains on preference pairs", dropout=False,
                     no_streaming="its reference log-probs are scored over the whole train split before training"),
    "reward": Objective("reward", metrics=frozenset({"preference_accuracy"}), data="preference",
                        data_need="trains on preference pairs", dropout=False, no_streaming=None),
    # exact_match of greedy completions against each eval row's answer; the mean reward is always reported
    "grpo": Objective("grpo", metrics=frozenset({"exact_match"}), data="prompt",
                      data_need="generates from prompt rows", dropout=False,
                      no_streaming="prompt rows are tokenized ahead, like the eval split"),
}

OWNED_FORMATS: Mapping[str, OwnedFormat] = {
    "preference": OwnedFormat("preference", "preference pairs", ("dpo", "reward"),
                              unpacked="each pair is one padded chosen/rejected batch",
                              answer_only="preference pairs learn from their answers only", metrics_of="dpo"),
    "prompt": OwnedFormat("prompt", "prompt rows", ("grpo",),
                          unpacked="task grpo trains on generated completions",
                          answer_only="task grpo learns from its completions only", metrics_of=None),
}


def objective(task: str | None) -> Objective | None:
    """The record of a recipe's ``task`` (None for ``task: null`` or a name that is not a task: the schema reports
    that)."""
    return OBJECTIVES.get(task) if task is not None else None


def metrics_task(task: str | None, data_format: str | None) -> str | None:
    """The task whose ``eval.metrics`` a recipe is checked against, when not the model row's: the recipe's task when
    its record lists metrics, else the owned format's ``metrics_of`` (its lines then name that task)."""
    record = objective(task)
    if record is not None and record.metrics is not None:
        return task
    owned = OWNED_FORMATS.get(data_format or "")
    return owned.metrics_of if owned is not None else None


def dropout_default(task: str | None) -> bool:
    """``train.dropout: null`` for ``task``: on, unless the task's record turns it off."""
    record = objective(task)
    return record.dropout if record is not None else True


def data_lines(task: str | None, data_format: str, packing: bool, train_on_prompt: bool) -> list[str]:
    """The lines that tie each owned format to its tasks, format by format: a task that needs the format gets
    another (that format's only line); the format under another task; the format packed or trained on prompts."""
    record = objective(task)
    lines = []
    for owned in OWNED_FORMATS.values():
        if record is not None and record.data == owned.format and data_format != owned.format:
            lines.append(f"task: {task} {record.data_need}; set data.format={owned.format} (got {data_format})")
            continue
        if data_format != owned.format:
            continue
        if task not in owned.tasks:
            lines.append(f"data.format: {owned.noun} train {' or '.join(f'task: {t}' for t in owned.tasks)}; set "
                         f"task (now {task or 'null'})")
        if packing:
            lines.append(f"data.packing: {owned.noun} are not packed ({owned.unpacked}); set data.packing=false")
        if train_on_prompt:
            lines.append(f"data.train_on_prompt: {owned.answer_only}; set it to false")
    return lines


__all__ = ["OBJECTIVES", "OWNED_FORMATS", "Objective", "OwnedFormat", "data_lines", "dropout_default", "metrics_task",
           "objective"]
