"""No output may be an input: the one list of what a recipe reads, and the one check every output goes through.

``run`` and ``resume`` write a run directory; ``merge``, ``export`` and ``generate`` write where ``-o`` says (``plot``
reads only runs, and its ``.png`` may not lie in one: :mod:`finetune.storage.plot`). That place may not be,
contain or lie inside anything the command reads (a ``merge -o BASE --overwrite`` once replaced
the base its adapter was trained on, and a later eval silently scored another model; a ``run -o R --overwrite``
deleted the reward run R its recipe scores with, then failed for want of it). :func:`recipe_inputs` is the one list
of what a recipe reads from disk: its files, every local path one of its keys names (:data:`KINDS`: one line per
kind of input) and the Hugging Face caches (:func:`cache_inputs`). An empty or blank ``-o`` (an unset shell
variable) is refused, never read as the current folder or a default. No torch here, and nothing is imported to find
a module: the CLI runs these checks before anything heavy is imported or any code a recipe names runs.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.config import accelerate, chat_templates
from finetune.errors import RunDirError

if TYPE_CHECKING:
    from finetune.config import RecipeConfig

Input = tuple[str, "Path | str | None"]  # (what it is, where), e.g. ("the model (model.path)", "runs/base/final")
Named = list[tuple[str, "str | None"]]  # (key, value) pairs of a recipe, e.g. [("model.path", "runs/base/final")]

REWARD_EXPORT = "final"  # a reward run's export, inside its run directory (where tasks.rewards.model_folder looks)


def given(value: str | None, flag: str = "-o") -> Path:
    """``value`` of ``flag`` as a path; an empty or blank value is one line (an unset variable, not a choice)."""
    if value is None or not value.strip():
        raise RunDirError(f"{flag} {value!r}: empty; give the path to write (an unset shell variable?)")
    return Path(value)


# --- where a value is read from --------------------------------------------------------------------------------


def local(value: str | Path) -> list[Path]:
    """``value`` as a local path when something is there (a hub id or dataset name is not: nothing local)."""
    try:
        path = Path(value).expanduser()
        return [path] if path.exists() or path.is_symlink() else []
    except (OSError, RuntimeError, ValueError):  # a name the OS refuses, an unknown ~user: nothing local
        return []


def module_files(value: str) -> list[Path]:
    """Where importing the module of ``value`` (``pkg.module`` or ``pkg.module:function``) reads its code from,
    found without importing or running anything: the folder(s) of its top-level package, or a plain module's own
    file; none when it cannot be found (validation says so) or has no file (a built-in)."""
    top = value.partition(":")[0].split(".")[0]
    try:  # a top-level name: find_spec imports no parent package, so no code runs
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(folder) for folder in spec.submodule_search_locations]
    return [Path(spec.origin)] if spec.has_location and spec.origin else []


def model_files(value: str) -> list[Path]:
    """What ``model.path`` reads: a local folder, or the package a ``pkg://module[/sub]`` path names."""
    if value.startswith("pkg://"):
        return module_files(value.removeprefix("pkg://").partition("/")[0])
    return local(value)


def reward_files(value: str) -> list[Path]:
    """What a ``reward_model`` reads: the folder as given, and the export inside it when it is a reward run (the
    folder :func:`finetune.tasks.rewards.model_folder` loads, which may be a link to elsewhere)."""
    folder = Path(value).expanduser()
    return [*local(folder), *local(folder / REWARD_EXPORT)]


def template_file(value: str) -> list[Path]:
    """The Jinja file ``model.chat_template`` names (none for a named template)."""
    return [] if chat_templates.is_name(value) else local(value)


def accelerate_file(value: str) -> list[Path]:
    """The accelerate config file ``launch.accelerate_config`` names (a path, or a shipped config's name)."""
    found = accelerate.locate(value)
    return [found] if found is not None else []


# --- what a recipe names ---------------------------------------------------------------------------------------


def _sources(key: str, value: Any) -> Named:
    """``data.train`` / ``data.eval``: one path, or a list of sources (each named by its own key)."""
    if value is None or isinstance(value, str):
        return [(key, value)]
    return [(f"{key}[{i}].path", source.path) for i, source in enumerate(value)]


def _each(items: Sequence[Any], key: str, field: str) -> Named:
    """``field`` of each item of the list ``key``, named ``key[i].field``."""
    return [(f"{key}[{i}].{field}", getattr(item, field)) for i, item in enumerate(items)]


@dataclass(frozen=True)
class Kind:
    """One kind of input a recipe names: what it is (in messages), the keys that name it with their values, and
    the local paths a value reads."""

    what: str
    named: Callable[[RecipeConfig], Named]
    reads: Callable[[str], list[Path]]


# Every kind of local input a recipe names. A new one (a distillation teacher, a reference model) is one line here.
KINDS: tuple[Kind, ...] = (
    Kind("the model", lambda cfg: [("model.path", cfg.model.path)], model_files),
    Kind("the model plugin", lambda cfg: [("model.plugin", cfg.model.plugin)], module_files),
    Kind("the chat template", lambda cfg: [("model.chat_template", cfg.model.chat_template)], template_file),
    Kind("a data file", lambda cfg: _sources("data.train", cfg.data.train), local),
    Kind("a data file", lambda cfg: _sources("data.eval", cfg.data.eval), local),
    Kind("the reward model", lambda cfg: _each(cfg.grpo.rewards, "grpo.rewards", "reward_model"), reward_files),
    Kind("the teacher", lambda cfg: [("distill.teacher", cfg.distill.teacher)], reward_files),
    Kind("the reward function's module", lambda cfg: _each(cfg.grpo.rewards, "grpo.rewards", "function"),
         module_files),
    Kind("the accelerate config", lambda cfg: [("launch.accelerate_config", cfg.launch.accelerate_config)],
         accelerate_file),
)


def cache_inputs() -> list[Input]:
    """The Hugging Face caches every recipe reads (the hub's models, the tokenized data), where ``datasets`` and
    ``huggingface_hub`` put them for this environment (the same variables and defaults, read without importing
    either): the HF home, the datasets cache and the hub cache."""
    env = os.environ.get
    home = Path(env("HF_HOME") or Path(env("XDG_CACHE_HOME") or "~/.cache") / "huggingface").expanduser()
    return [("the Hugging Face cache ($HF_HOME)", home),
            ("the datasets cache ($HF_DATASETS_CACHE)", Path(env("HF_DATASETS_CACHE") or home / "datasets")),
            ("the hub cache ($HF_HUB_CACHE)",
             Path(env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE") or home / "hub").expanduser())]


def recipe_inputs(cfg: RecipeConfig, files: Sequence[Path] = ()) -> list[Input]:
    """Everything a run of ``cfg`` reads from disk: the recipe ``files`` (the recipe last, after the files it
    ``extends:``), each local path of :data:`KINDS` (named by its key) and the caches (:func:`cache_inputs`)."""
    found: list[Input] = [("the recipe" if i == len(files) - 1 else "a recipe it extends (extends:)", path)
                          for i, path in enumerate(files)]
    for kind in KINDS:
        found += [(f"{kind.what} ({key})", path) for key, value in kind.named(cfg) if value
                  for path in kind.reads(value)]
    return found + cache_inputs()


# --- the check -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Overlap:
    """How an output stands to one input: ``how`` it is, contains or lies inside ``what`` at ``where`` (as given),
    which is ``source`` once links are resolved."""

    how: str  # "is" | "contains" | "lies inside"
    what: str
    where: Path | str
    source: Path

    @property
    def input(self) -> str:
        """The input as a message names it: what it is, its path, and where that leads through a link."""
        linked = f" (that is {self.source})" if self.source != Path(os.path.abspath(self.where)) else ""
        return f"{self.what} {self.where}{linked}".strip()


def overlap(out: Path, inputs: Iterable[Input]) -> Overlap | None:
    """The first of ``inputs`` that ``out`` is, contains or lies inside (links resolved), else None."""
    target = out.resolve()
    for what, where in inputs:
        if not where:
            continue
        source = Path(where).resolve()
        if target == source:
            return Overlap("is", what, where, source)
        if source in target.parents:
            return Overlap("lies inside", what, where, source)
        if target in source.parents:
            return Overlap("contains", what, where, source)
    return None


def check_not_input(out: Path, inputs: Iterable[Input], flag: str = "-o", fix: str = "write somewhere else") -> None:
    """Refuse ``out`` when it is, contains or lies inside any of ``inputs`` (:func:`overlap`): one line naming
    ``flag``, the input and its path, and ``fix``."""
    found = overlap(out, inputs)
    if found is not None:
        raise RunDirError(f"{flag} {out}: {found.how} {found.input}, which this command reads; {fix}")
