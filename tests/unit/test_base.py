"""The Task protocol declares everything the loop and the builders ask of a task.

Every task class of finetune/tasks has every member the protocol declares, methods with the protocol's parameters;
and the modules that drive a task (the worker, the loop, evaluation) name no concrete task class: they import none
and test for none with isinstance, so a new task needs no line in them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import finetune.tasks
from finetune.data import DataBundle
from finetune.tasks.base import Task, TaskData

ROOT = Path(finetune.tasks.__file__).parents[1]
DRIVERS = ("runtime/worker.py", "runtime/loop.py", "commands/evaluate.py")  # the modules that build and run a task


def declared() -> tuple[set[str], set[str]]:
    """The protocol's attributes (its annotations) and its methods (the functions of its body)."""
    attributes = set(Task.__annotations__)
    methods = {name for name, value in vars(Task).items() if inspect.isfunction(value) and not name.startswith("_")}
    return attributes, methods


def task_classes() -> list[type]:
    """Every class defined in finetune/tasks that a run can train: a TaskData with a loss (not the shared bases)."""
    found = {}
    for info in pkgutil.iter_modules(finetune.tasks.__path__):
        module = importlib.import_module(f"finetune.tasks.{info.name}")
        for value in vars(module).values():
            if (inspect.isclass(value) and value.__module__ == module.__name__ and issubclass(value, TaskData)
                    and callable(getattr(value, "train_output", None))):
                found[value.__qualname__] = value
    return sorted(found.values(), key=lambda cls: cls.__qualname__)


def instance(cls: type) -> Any:
    """``cls`` over empty data and the few recipe fields the constructors read."""
    cfg = SimpleNamespace(eval=SimpleNamespace(metrics=[], max_new_tokens=4, batch_size=2),
                          train=SimpleNamespace(global_batch_size=2, micro_batch_size=1, seed=0),
                          data=SimpleNamespace(shuffle=False, packing=False, num_workers=None, format=None),
                          distill=SimpleNamespace(loss="forward_kl", beta=0.5, temperature=1.0, top_k=None, alpha=0.0,
                                                  mode="offline", lmbda=1.0, max_new_tokens=4, teacher=None))
    keywords = {name for base in cls.__mro__ if "__init__" in vars(base)
                for name, p in inspect.signature(vars(base)["__init__"]).parameters.items() if p.kind == p.KEYWORD_ONLY}
    extra = {name: object() for name in keywords}  # tokenizer, images: not read by what is checked here
    return cls(cfg, DataBundle(None, None, None), 0, 0, 1, **extra)


def test_the_protocol_declares_what_the_loop_and_the_builders_read() -> None:
    attributes, methods = declared()
    assert {"data", "eval_means", "perplexity"} <= attributes
    assert {"prepare", "build_dataloader", "count_targets", "train_output", "eval_output", "count_samples"} <= methods


def test_every_task_class_has_every_member_of_the_protocol() -> None:
    classes = task_classes()
    assert {cls.__name__ for cls in classes} >= {"CausalLMTask", "ClassificationTask", "DPOTask", "RewardTask",
                                                 "VisionCausalLMTask"}
    attributes, methods = declared()
    for cls in classes:
        task = instance(cls)
        missing = sorted(name for name in attributes | methods if not hasattr(task, name))
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert isinstance(task.data, DataBundle) and isinstance(task.perplexity, bool), cls.__name__
        assert isinstance(task.eval_means, tuple) and all(isinstance(n, str) for n in task.eval_means), cls.__name__
        for name in methods:
            want = list(inspect.signature(getattr(Task, name)).parameters)[1:]
            got = list(inspect.signature(getattr(task, name)).parameters)
            assert got == want, f"{cls.__name__}.{name}{got} differs from Task.{name}{want}"


def test_preparing_a_task_without_a_reference_never_builds_the_initial_model() -> None:
    """Only a task that needs the initial model asks for it (``finetune eval`` builds a base model for it)."""
    for cls in task_classes():
        # DPO scores its reference, GRPO generates with the model, distillation places its teacher beside it
        if cls.__name__ in ("DPOTask", "GRPOTask", "DistillTask"):
            continue
        instance(cls).prepare(lambda: pytest.fail("built the initial model"), None, None, print)


def concrete_names() -> set[str]:
    """The names a driver must not use: every task class, their shared bases, and DPO's reference pass."""
    return {cls.__name__ for cls in task_classes()} | {"TaskData", "PairTask", "compute_reference"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_no_driver_names_a_concrete_task(driver: str) -> None:
    tree = ast.parse((ROOT / driver).read_text(), driver)
    banned = concrete_names()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune.tasks"):
            assert node.module in ("finetune.tasks", "finetune.tasks.base"), \
                f"{driver}:{node.lineno} imports the task module {node.module}"
            named = sorted(alias.name for alias in node.names if alias.name in banned)
            assert not named, f"{driver}:{node.lineno} imports {named}"
        if isinstance(node, ast.Import):
            assert not any(alias.name.startswith("finetune.tasks.") for alias in node.names), \
                f"{driver}:{node.lineno} imports a task module"
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            assert name not in banned, f"{driver}:{node.lineno} names {name}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                                 "issubclass"):
            kinds = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
            assert "Task" not in kinds, f"{driver}:{node.lineno} tests a task's class: {ast.unparse(node)}"
