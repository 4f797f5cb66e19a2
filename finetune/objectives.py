"""The training objectives a recipe's ``task`` key names, and the data formats that belong to one, as data.

Why a table: the rules of a task (which data it trains on, which eval metrics it reports, whether dropout stays on,
whether its data may stream, be packed or train on prompts, which model rows it trains, whether it generates, how
many steps a batch trains, when it needs the reference weights, what its run leads with) were ``cfg.task == ...``
tests spread over the schema, the validator, storage, the plan and the runtime. Each is now a field of the task's
record here, and those modules ask the record (``tests/unit/test_objectives.py`` scans the package for a task
compared with its name); adding a task means its module in ``finetune/tasks/`` and its row here
(docs/architecture.md says how). Torch-free and import-light: the schema and the CLI read it.

``task: null`` trains the model row's own task (``causal_lm``, ``vision_causal_lm``, ``classification``): its rules
are the row's (``finetune.registry.ROW_TASKS``); :data:`OBJECTIVES` holds the tasks a recipe
names. :data:`OWNED_FORMATS` holds the data formats only some tasks train on (preference pairs, prompt rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Objective:
    """One value of the recipe's ``task`` key.

    ``metrics``: the ``eval.metrics`` it reports (None: the model row's own); ``data``: the data format it trains on
    (None: the row's formats) and ``data_need``: how its one line says so (``task: X {data_need}; set
    data.format=...``); ``dropout``: what ``train.dropout: null`` means for it (off where the loss compares scores
    made without dropout); ``no_streaming``: why it cannot train on ``data.streaming`` (None: it can).

    The model row it trains (:func:`row_line`): ``row_tasks``, the model rows' tasks it trains (None: any), and
    ``row_capability``, one capability those rows must have; ``row_need`` says what it trains in its line and
    ``row_hint`` what to do instead. ``builds``: the model-row task a run of it builds the row as
    (``finetune.registry.for_task``; None: the row as it is).

    What it runs: ``generates``: it trains on completions it generates from prompt rows (``grpo.max_new_tokens`` of
    ``data.max_seq_len`` are theirs); ``rewards``: ``grpo.rewards`` score them (at least one; their functions'
    sources and reward models are part of its objective); ``repeats_batches``: one global batch trains
    ``grpo.iterations`` optimizer steps; ``groups``: ``train.micro_batch_size`` counts prompts, each
    ``grpo.group_size`` sequences (what the memory plan counts). ``reference``: when it compares with the initial
    weights (``"always"``, ``"beta"``: with ``grpo.beta`` > 0, ``"never"``), so that ``model.path`` defines its
    objective; ``reference_copy``: that reference is a frozen copy of the weights held through training under full
    fine-tuning (the plan counts it; FSDP1 cannot build it), rather than scored ahead.

    What its run reports: ``headline``: the train and the eval keys its step lines, summary and plot lead with
    (None: the loss first, ``finetune.storage.metrics.LOSS_FIRST``; a ``"loss"`` among the train keys leads only
    where its value carries information, see ``grpo_loss_informative``); ``collapse``: the collapse signature of
    its runs (``finetune.runtime.collapse``): ``"row"`` the model row's, ``"pairs"`` a score pair's, ``"unknown"``
    a dead loss that is not a known constant, ``"never"`` not checked. ``teacher``: it learns from a frozen
    teacher model (``distill.teacher``), which defines its objective as a reference does. ``prompt_section``: the
    recipe section whose ``max_new_tokens`` is the room a prompt row leaves for its completion (the task reads prompt
    rows; None: it reads none). ``panels``: the panels its
    plot draws first, in order (``finetune.storage.plot``; None: the loss, lr and gradient norm, then every eval
    metric): train keys, ``eval_`` keys, and ``prefix*`` for every train key with that prefix that a run logged (a
    reward per function), drawn for a run that logged at least two of them (with one, its curve is the total's); a
    panel whose key no run logged is left out, and whatever the list does not name follows in the default order."""

    name: str
    metrics: frozenset[str] | None
    data: str | None
    data_need: str
    dropout: bool
    no_streaming: str | None
    row_tasks: frozenset[str] | None = None
    row_capability: str | None = None
    row_need: str = ""
    row_hint: str = ""
    builds: str | None = None
    generates: bool = False
    rewards: bool = False
    repeats_batches: bool = False
    groups: bool = False
    reference: Literal["never", "always", "beta"] = "never"
    reference_copy: bool = False
    teacher: bool = False
    prompt_section: str | None = None
    headline: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    collapse: Literal["row", "pairs", "unknown", "never"] = "row"
    panels: tuple[str, ...] | None = None


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


_CAUSAL_HINT = "use a causal LM model type (finetune models)"  # the preference tasks' refusal of a model row

OBJECTIVES: Mapping[str, Objective] = {
    "sft": Objective("sft", metrics=None, data=None, data_need="", dropout=True, no_streaming=None,
                     row_tasks=frozenset({"causal_lm", "vision_causal_lm"}), row_need="trains causal LMs",
                     row_hint="use task: null"),
    # the loss of a dead policy depends on the reference log-probs: its collapse loss is not a known constant
    "dpo": Objective("dpo", metrics=frozenset({"preference_accuracy"}), data="preference",
                     data_need="trains on preference pairs", dropout=False,
                     no_streaming="its reference log-probs are scored over the whole train split before training",
                     row_capability="preference", row_hint=_CAUSAL_HINT, reference="always", collapse="unknown"),
    "reward": Objective("reward", metrics=frozenset({"preference_accuracy"}), data="preference",
                        data_need="trains on preference pairs", dropout=False, no_streaming=None,
                        row_capability="preference", row_hint=_CAUSAL_HINT, builds="reward", collapse="pairs"),
    # exact_match of greedy completions against each eval row's answer; the mean reward is always reported. Never
    # checked for collapse: a group whose completions got equal rewards has advantage 0, a zero gradient at any loss.
    # Its plot: the rewards and the eval first, then how the completions change (length, and KL to the reference,
    # logged with grpo.beta > 0), then the optimizer's panels (its loss only where informative: headline)
    "grpo": Objective("grpo", metrics=frozenset({"exact_match"}), data="prompt",
                      data_need="generates from prompt rows", dropout=False,
                      no_streaming="prompt rows are tokenized ahead, like the eval split",
                      row_tasks=frozenset({"causal_lm"}), row_capability="generation",
                      row_need="trains a causal LM on its own generated text",
                      row_hint="use a causal LM model type that generates (finetune models)",
                      generates=True, prompt_section="grpo", rewards=True, repeats_batches=True, groups=True,
                      reference="beta", reference_copy=True,
                      headline=(("reward", "loss"), ("eval_exact_match", "eval_reward")),
                      collapse="never", panels=("reward", "eval_exact_match", "eval_reward", "reward_*",
                                                "completion_len", "kl", "loss", "lr", "grad_norm")),
    # distillation: SFT's rows (the data's answers offline, their prompts on-policy) or prompt rows (on-policy only),
    # a teacher's distributions as targets; a dead student's divergence depends on the teacher: no known constant
    "distill": Objective("distill", metrics=None, data=None, data_need="", dropout=True, no_streaming=None,
                         row_tasks=frozenset({"causal_lm"}), row_need="distills into a causal LM",
                         row_hint="use a causal LM model type (finetune models)", teacher=True, collapse="unknown",
                         prompt_section="distill"),
}

OWNED_FORMATS: Mapping[str, OwnedFormat] = {
    "preference": OwnedFormat("preference", "preference pairs", ("dpo", "reward"),
                              unpacked="each pair is one padded chosen/rejected batch",
                              answer_only="preference pairs learn from their answers only", metrics_of="dpo"),
    "prompt": OwnedFormat("prompt", "prompt rows", ("grpo", "distill"),
                          unpacked="their tasks train on generated completions",
                          answer_only="their tasks learn from generated completions only", metrics_of=None),
}


def objective(task: object) -> Objective | None:
    """The record of a recipe's ``task`` (None for ``task: null`` or a value that is not a task: the schema reports
    that; a recipe read back as plain data may hold any value there)."""
    return OBJECTIVES.get(task) if isinstance(task, str) else None


def needs_reference(task: str | None, cfg: Any) -> bool:
    """Whether a run of ``task`` compares with the initial weights (its record's ``reference``); ``cfg.grpo.beta``
    is read only where the record says the KL weight decides."""
    record = objective(task)
    if record is None or record.reference == "never":
        return False
    return record.reference == "always" or cfg.grpo.beta > 0


def row_line(task: str | None, name: str, row_task: str, capabilities: frozenset[str]) -> str | None:
    """The line refusing a model row (``name``, of ``row_task``, with ``capabilities``) that ``task`` cannot train
    (its record's ``row_tasks`` and ``row_capability``); None where it can. A record that asks a capability alone
    names the row first; one that asks a row task names itself first, and the capability only for a row of a task
    it trains."""
    record = objective(task)
    if record is None:
        return None
    task_fits = record.row_tasks is None or row_task in record.row_tasks
    capable = record.row_capability is None or record.row_capability in capabilities
    if task_fits and capable:
        return None
    if record.row_tasks is None:
        return (f"task: {name} ({row_task}) cannot train task {task}: it lacks the {record.row_capability} "
                f"capability; {record.row_hint}")
    lacks = f" without the {record.row_capability} capability" if task_fits else ""
    return f"task: {task} {record.row_need}, but {name} is a {row_task} model{lacks}; {record.row_hint}"


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
           "needs_reference", "objective", "row_line"]
