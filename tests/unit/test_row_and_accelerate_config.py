"""One home for a look-up every command needs: the model row. ``registry.recipe_row`` is the one resolver of a
recipe's row (model.type as its task builds it); no module reads the table with a task rule of its own, and the
worker carries the row it resolved. (The other such look-up, the accelerate config, is test_accelerate.py.)
"""

from __future__ import annotations

import ast

from tests.package_ast import called, functions, modules

# Callers of the table that are not a recipe's row: the row a checkpoint's manifest recorded at training time
# (finetune.storage.record) is read back by its stored name and task.
TABLE_READERS = {"registry.py", "record.py"}


def test_the_row_is_resolved_only_by_recipe_row() -> None:
    """No module but the registry calls ``get_model`` or ``for_task`` (each with its own idea of the task)."""
    found = [f"{name}:{node.lineno}" for name, tree in modules() if name not in TABLE_READERS
             for node in ast.walk(tree)
             if isinstance(node, ast.Call) and called(node) in ("get_model", "for_task")]
    assert found == [], f"the row is looked up outside registry.recipe_row at {found}"


def test_the_worker_carries_the_row_it_resolved() -> None:
    """build_trainer resolves the row once (or takes the one prepare.inputs read for) and hands it to the run's
    context; the checkpoints, the export's clean copy and the end summary take it from there."""
    from finetune.runtime import context, prepare

    assert "row" in context.RunContext.__dataclass_fields__ and "row" in prepare.Inputs.__dataclass_fields__
    worker = dict(modules())["worker.py"]
    trainer = next(f for f in functions(worker) if f.name == "build_trainer")
    calls = [node for node in ast.walk(trainer) if isinstance(node, ast.Call)]
    assert sum(called(node) == "recipe_row" for node in calls) == 1
    made = [node for node in ast.walk(worker) if isinstance(node, ast.Call) and called(node) == "RunContext"]
    assert len(made) == 1 and any(keyword.arg == "row" for keyword in made[0].keywords)
