"""No output may be an input: every kind of input a recipe reads (its files, the model, the plugin, the chat template
file, the data, the reward models and functions, the accelerate config, the Hugging Face caches) is refused as an
output that is it, contains it or lies inside it, by the one list (finetune.config.outputs.recipe_inputs) and by
`finetune run`, in one line naming the key and the path, before anything is created, read or deleted."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from finetune.config import outputs
from finetune.config.compose import compose
from finetune.config.schema import RecipeConfig
from finetune.errors import RunDirError
from tests.cli_helpers import assert_user_error, main_exit
from tests.recipe_files import write_recipe_file

PLUGIN = "finetune_outputs_probe_plugin"  # names no installed module has
REWARDS = "finetune_outputs_probe_rewards"


@dataclass
class Inputs:
    """A GRPO recipe naming one input of every kind, each alone in its own folder under ``root``; ``paths``: each
    kind's input (what an output may not be, contain or lie inside) by the key its refusal names."""

    root: Path
    recipe: Path
    paths: dict[str, Path]
    imported: Path  # written by the plugin or the reward package when their code runs

    def snapshot(self) -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in sorted(self.root.rglob("*")) if p.is_file()}


def _file(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _model(folder: Path) -> Path:
    """A folder that validates as a model (config.json and a weights file; nothing loads it here)."""
    _file(folder / "config.json", json.dumps({"model_type": "llama"}))
    _file(folder / "model.safetensors")
    return folder


@pytest.fixture
def every_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Inputs]:
    root, imported = tmp_path / "inputs", tmp_path / "IMPORTED"
    runs_code = f"open({str(imported)!r}, 'a').write(__name__)\n"
    plugin = _file(root / "plugin" / f"{PLUGIN}.py", runs_code)  # a plain module: its own file
    rewards = root / "rewardfn" / REWARDS  # a package: its folder
    _file(rewards / "__init__.py", runs_code)
    _file(rewards / "scores.py", "def score(prompts, completions, rows):\n    return [0.0] * len(completions)\n")
    for folder in (plugin.parent, rewards.parent):
        monkeypatch.syspath_prepend(str(folder))
    reward_run = root / "reward" / "run"
    _model(reward_run / "final")
    linked_export = _model(root / "export" / "final")
    teacher = _model(root / "teacher" / "model")
    (root / "linked" / "run").mkdir(parents=True)
    (root / "linked" / "run" / "final").symlink_to(linked_export)  # the export a reward run's final/ points to
    accelerate = _file(root / "accelerate" / "mine.yaml", "distributed_type: NO\nnum_processes: 1\n")
    prompts = "".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(4))
    base = write_recipe_file(_file(root / "base" / "base.yaml"), {"train": {"max_steps": 1}})
    recipe = write_recipe_file(_file(root / "recipe" / "recipe.yaml"), {
        "extends": [str(base)], "name": "probe", "task": "grpo",
        "model": {"type": "tiny-llama", "path": str(_model(root / "model" / "weights")), "plugin": PLUGIN,
                  "chat_template": str(_file(root / "template" / "chat.jinja", "{{ messages[0]['content'] }}"))},
        "data": {"format": "prompt", "train": str(_file(root / "train" / "train.jsonl", prompts)),
                 "eval": [{"path": str(_file(root / "eval" / "eval.jsonl", prompts))}], "max_seq_len": 32},
        "train": {"micro_batch_size": 2, "global_batch_size": 2},
        "grpo": {"group_size": 2, "max_new_tokens": 2, "rewards": [
            {"reward_model": str(reward_run)}, {"reward_model": str(root / "linked" / "run"), "name": "linked"},
            {"function": f"{REWARDS}.scores:score"}]},
        "distill": {"teacher": str(teacher)},
        "launch": {"accelerate_config": str(accelerate)}})
    caches = {"HF_HOME": root / "hf" / "home", "HF_DATASETS_CACHE": root / "datasets" / "cache",
              "HF_HUB_CACHE": root / "hub" / "cache"}
    for name, folder in caches.items():
        folder.mkdir(parents=True)
        monkeypatch.setenv(name, str(folder))
    paths = {"the recipe": recipe, "extends:": base, "model.path": root / "model" / "weights", "model.plugin": plugin,
             "model.chat_template": root / "template" / "chat.jinja",
             "data.train": root / "train" / "train.jsonl", "data.eval[0].path": root / "eval" / "eval.jsonl",
             "grpo.rewards[0].reward_model": reward_run, "grpo.rewards[1].reward_model": linked_export,
             "grpo.rewards[2].function": rewards, "distill.teacher": teacher, "launch.accelerate_config": accelerate,
             **{f"${name}": folder for name, folder in caches.items()}}
    yield Inputs(root, recipe, paths, imported)
    for name in (PLUGIN, REWARDS, f"{REWARDS}.scores"):  # `finetune run` imports the plugin of its recipe
        sys.modules.pop(name, None)


# How an output stands to an input (each input is alone in its folder: that folder contains it and nothing else).
RELATIONS: dict[str, Callable[[Path], Path]] = {
    "is": lambda path: path, "contains": lambda path: path.parent, "lies inside": lambda path: path / "out"}
KEYS = ["the recipe", "extends:", "model.path", "model.plugin", "model.chat_template", "data.train",
        "data.eval[0].path", "grpo.rewards[0].reward_model", "grpo.rewards[1].reward_model", "grpo.rewards[2].function",
        "distill.teacher", "launch.accelerate_config", "$HF_HOME", "$HF_DATASETS_CACHE", "$HF_HUB_CACHE"]


def _refusal(out: Path, how: str, key: str, path: Path) -> str:
    """The pattern of the one line that refuses ``-o out``: how it stands to the input, the key and the path."""
    return rf"{re.escape(str(out))}: {how} [^\n]*{re.escape(key)}[^\n]*{re.escape(str(path))}\)?, which this command"


RUN_DIR_RELATIONS = {"is": "it is {}", "contains": "{} is in it", "lies inside": "it lies inside {}"}


def _run_dir_refusal(out: Path, how: str, key: str, path: Path) -> str:
    """The pattern of the one line that refuses ``out`` as a run directory (finetune.storage.rundir's words)."""
    named = rf"[^\n]*{re.escape(key)}[^\n]*{re.escape(str(path))}\)?"
    why = re.escape(RUN_DIR_RELATIONS[how]).replace(re.escape("{}"), named)
    return rf"{re.escape(str(out))}: cannot be a run directory \({why}\); choose another output_dir / -o"


def test_every_kind_is_listed(every_input: Inputs) -> None:
    """The fixture names every kind the list knows (a kind added to outputs.KINDS needs a case here)."""
    assert len(outputs.KINDS) == 9
    composed = compose(every_input.recipe)
    listed = {where for _, where in outputs.recipe_inputs(RecipeConfig.model_validate(composed.data), composed.files)}
    assert {str(Path(p)) for p in every_input.paths.values()} <= {str(Path(p).resolve()) for p in listed}


@pytest.mark.parametrize("how", sorted(RELATIONS))
@pytest.mark.parametrize("key", KEYS)
def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused(every_input: Inputs, key: str, how: str) -> None:
    """recipe_inputs + check_not_input, for every kind and relation: one line naming the key and the path. Nothing
    a recipe names is imported to find its module (the plugin's and the reward package's code never run)."""
    composed = compose(every_input.recipe)
    inputs = outputs.recipe_inputs(RecipeConfig.model_validate(composed.data), composed.files)
    path = every_input.paths[key]
    out = RELATIONS[how](path)
    with pytest.raises(RunDirError, match=_refusal(out, how, key, path)):
        outputs.check_not_input(out, inputs)
    outputs.check_not_input(path.parent.with_name(path.parent.name + "-sibling"), inputs)
    assert not every_input.imported.exists() and PLUGIN not in sys.modules and REWARDS not in sys.modules


@pytest.mark.parametrize("how", sorted(RELATIONS))
@pytest.mark.parametrize("key", KEYS)
def test_run_refuses_an_input_as_its_run_dir_before_anything(every_input: Inputs, key: str, how: str,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`finetune run RECIPE -o OUT --overwrite` (and --dry-run) with OUT an input, around one or inside one: one
    line naming the key, exit 2; nothing created, tokenized or deleted."""
    path = every_input.paths[key]
    out = RELATIONS[how](path)
    before = every_input.snapshot()
    for flag in ("--overwrite", "--dry-run"):
        code, stdout, err = main_exit(monkeypatch, capsys, "run", str(every_input.recipe), "-o", str(out), flag)
        assert_user_error(code, stdout, err)
        assert re.search(_run_dir_refusal(out, how, key, path), err), err
    assert every_input.snapshot() == before
    assert how != "lies inside" or not out.exists()


CACHE_VARIABLES = ("HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")


@pytest.mark.parametrize("variables, caches", [
    ({"HOME": "user"}, ["user/.cache/huggingface", "user/.cache/huggingface/datasets", "user/.cache/huggingface/hub"]),
    ({"HOME": "user", "XDG_CACHE_HOME": "xdg"}, ["xdg/huggingface", "xdg/huggingface/datasets", "xdg/huggingface/hub"]),
    ({"HOME": "user", "HF_HOME": "home"}, ["home", "home/datasets", "home/hub"]),
    ({"HOME": "user", "HF_HOME": "home", "HF_DATASETS_CACHE": "data", "HUGGINGFACE_HUB_CACHE": "old"},
     ["home", "data", "old"]),
    ({"HOME": "user", "HUGGINGFACE_HUB_CACHE": "old", "HF_HUB_CACHE": "new"},
     ["user/.cache/huggingface", "user/.cache/huggingface/datasets", "new"]),
])
def test_the_caches_are_where_the_libraries_put_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     variables: dict[str, str], caches: list[str]) -> None:
    """The HF home, datasets cache and hub cache follow the variables datasets and huggingface_hub read, with their
    defaults."""
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    assert [Path(where) for _, where in outputs.cache_inputs()] == [tmp_path / cache for cache in caches]


def test_the_cache_folder_of_home_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`-o ~/.cache` holds the Hugging Face cache (no variable set: its default place)."""
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(RunDirError, match=r"-o .*/\.cache: contains the Hugging Face cache \(\$HF_HOME\)"):
        outputs.check_not_input(Path("~/.cache").expanduser(), outputs.cache_inputs())


def test_the_caches_of_this_process_are_the_libraries_own() -> None:
    """In this process's environment, the three folders are the ones huggingface_hub and datasets use."""
    from datasets import config  # lazy: heavy
    from huggingface_hub import constants  # lazy: heavy

    assert [Path(where) for _, where in outputs.cache_inputs()] == [
        Path(constants.HF_HOME), Path(config.HF_DATASETS_CACHE), Path(constants.HF_HUB_CACHE)]


def test_a_reward_run_is_protected_where_the_reward_model_is_loaded_from(every_input: Inputs) -> None:
    """The reward folder a GRPO run loads (finetune.tasks.rewards.model_folder, which picks a run's final/) is among
    the inputs, through a link too."""
    from finetune.tasks.rewards import model_folder  # lazy: imports torch

    composed = compose(every_input.recipe)
    cfg = RecipeConfig.model_validate(composed.data)
    listed = {Path(where).resolve() for _, where in outputs.recipe_inputs(cfg)}
    for spec in cfg.grpo.rewards:
        if spec.reward_model:
            assert model_folder(spec.reward_model, "key").resolve() in listed
