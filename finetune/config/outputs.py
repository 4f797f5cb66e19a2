"""No output may be an input: the one check every command's ``-o`` goes through.

``merge``, ``export``, ``generate`` and ``plot`` write where ``-o`` says. That place may not be, contain or lie
inside anything the command reads: the model folder, the adapter, the base model, the data files, the recipe, the
prompts (a ``merge -o BASE --overwrite`` once replaced the base its adapter was trained on, and a later eval
silently scored another model). An empty or blank ``-o`` (an unset shell variable) is refused, never read as the
current folder or a default. No torch here: the CLI runs these checks before anything heavy is imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.errors import RunDirError

if TYPE_CHECKING:
    from finetune.config import RecipeConfig

Input = tuple[str, "Path | str | None"]  # (what it is, where), e.g. ("the base model", "runs/base/final")


def given(value: str | None, flag: str = "-o") -> Path:
    """``value`` of ``flag`` as a path; an empty or blank value is one line (an unset variable, not a choice)."""
    if value is None or not value.strip():
        raise RunDirError(f"{flag} {value!r}: empty; give the path to write (an unset shell variable?)")
    return Path(value)


def recipe_inputs(cfg: RecipeConfig) -> list[Input]:
    """What a run's recipe reads from disk: its local model folder and its local data files."""
    found: list[Input] = []
    if cfg.model.path and Path(cfg.model.path).exists():
        found.append(("the model (model.path)", cfg.model.path))
    for key, sources in (("data.train", cfg.data.train_sources()), ("data.eval", cfg.data.eval_sources())):
        found += [(f"a data file ({key})", s.path) for s in sources if Path(s.path).exists()]
    return found


def check_not_input(out: Path, inputs: Iterable[Input], flag: str = "-o") -> None:
    """Refuse ``out`` when it is, contains or lies inside any of ``inputs`` (links resolved), one line naming it."""
    target = out.resolve()
    for what, where in inputs:
        if not where:
            continue
        source = Path(where).resolve()
        if target == source:
            how = "is"
        elif source in target.parents:
            how = "lies inside"
        elif target in source.parents:
            how = "contains"
        else:
            continue
        raise RunDirError(f"{flag} {out}: {how} {what} {where}, which this command reads; write somewhere else")
