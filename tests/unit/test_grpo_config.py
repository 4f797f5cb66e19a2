"""The recipe keys of task grpo: the grpo section's defaults and ranges, the reward items (exactly one kind each,
a regex that compiles, a function named pkg.module:name, unique metric names), task grpo <-> data.format prompt,
and what prompt rows refuse (packing, train_on_prompt, streaming). Every refusal is one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from finetune.config import load_recipe
from finetune.config.schema import RecipeConfig, recipe_file_schema
from finetune.config.validate import _all_keys
from finetune.errors import ConfigError

ROWS = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]


@pytest.fixture
def grpo_recipe(write_recipe, minimal_recipe, tmp_path: Path):
    """A valid task: grpo recipe on a prompts file; ``make(overrides, **sections)`` -> load_recipe's config."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))

    def make(overrides: list[str] | None = None, **sections: Any) -> Any:
        recipe = {**minimal_recipe, "task": "grpo", "data": {"format": "prompt", "train": "prompts.jsonl"},
                  "grpo": {"rewards": [{"exact_match": True}]}, **sections}
        return load_recipe(write_recipe(recipe), overrides or [])[0]

    return make


def _lines(make, overrides: list[str] | None = None, **sections: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        make(overrides, **sections)
    return str(info.value).splitlines()


def _one_line(make, overrides: list[str] | None = None, **sections: Any) -> str:
    lines = _lines(make, overrides, **sections)
    assert len(lines) == 1, lines
    return lines[0]


def test_a_grpo_recipe_validates_with_its_defaults(grpo_recipe) -> None:
    cfg = grpo_recipe()
    assert cfg.task == "grpo" and cfg.data.format == "prompt"
    g = cfg.grpo
    assert (g.group_size, g.max_new_tokens, g.temperature, g.top_p, g.beta, g.epsilon, g.iterations, g.loss) == \
        (4, 32, 1.0, 1.0, 0.0, 0.2, 1, "grpo")
    assert [(r.kind, r.metric, r.weight) for r in g.rewards] == [("exact_match", "exact_match", 1.0)]


def test_every_reward_kind_and_its_default_name(grpo_recipe) -> None:
    rewards = [{"exact_match": True}, {"regex": r"^\d+$", "weight": 0.5}, {"function": "json.decoder:score_it"},
               {"regex": "x", "name": "has_x", "weight": -1}]
    cfg = grpo_recipe(grpo={"rewards": rewards, "loss": "dr_grpo", "group_size": 8})
    assert [r.metric for r in cfg.grpo.rewards] == ["exact_match", "regex", "score_it", "has_x"]
    assert [r.weight for r in cfg.grpo.rewards] == [1.0, 0.5, 1.0, -1.0]
    assert cfg.grpo.loss == "dr_grpo" and cfg.grpo.group_size == 8


@pytest.mark.parametrize(("reward", "needle"), [
    ({"regex": "("}, "grpo.rewards[1].regex: '(' is not a regular expression"),
    ({"function": "no_colon"}, "grpo.rewards[1].function: 'no_colon' must name a function as "
                               "'package.module:function'"),
    ({"function": "a.b:c d"}, "grpo.rewards[1].function: "),
    ({"exact_match": True, "regex": "a"}, "grpo.rewards[1]: a reward item needs exactly one of exact_match, regex, "
                                          "function, reward_model; this one has exact_match and regex"),
    ({"weight": 2.0}, "grpo.rewards[1]: a reward item needs exactly one of exact_match, regex, function, "
                      "reward_model; this one names none"),
    ({"exact_match": False}, "grpo.rewards[1].exact_match: false names no reward; write exact_match: true, or "
                             "remove the item"),
    ({"exact_match": "yes"}, "grpo.rewards[1].exact_match: Input should be True"),
    ({"regx": "a"}, "grpo.rewards[1].regx: unknown key; did you mean grpo.rewards[1].regex?"),
    ({"exact_match": True}, "grpo.rewards: reward names must be unique, but 'exact_match' names more than one"),
    ({"regex": "a", "weight": float("nan")}, "grpo.rewards[1].weight"),
])
def test_a_bad_reward_item_is_one_line_naming_it(grpo_recipe, reward: dict, needle: str) -> None:
    line = _one_line(grpo_recipe, grpo={"rewards": [{"exact_match": True}, reward]})
    assert line.startswith(needle), line


@pytest.mark.parametrize(("override", "needle"), [
    ("grpo.group_size=1", "grpo.group_size: Input should be greater than or equal to 2"),
    ("grpo.max_new_tokens=0", "grpo.max_new_tokens: Input should be greater than or equal to 1"),
    ("grpo.temperature=0", "grpo.temperature: Input should be greater than 0"),
    ("grpo.top_p=0", "grpo.top_p: Input should be greater than 0"),
    ("grpo.top_p=1.5", "grpo.top_p: Input should be less than or equal to 1"),
    ("grpo.beta=-0.1", "grpo.beta: Input should be greater than or equal to 0"),
    ("grpo.epsilon=0", "grpo.epsilon: Input should be greater than 0"),
    ("grpo.iterations=0", "grpo.iterations: Input should be greater than or equal to 1"),
    ("grpo.loss=seq", "grpo.loss: Input should be 'grpo', 'token' or 'dr_grpo'"),
    ("grpo.rewards=[]", "grpo.rewards: task grpo needs at least one reward"),
    ("grpo.max_new_tokens=256", "grpo.max_new_tokens=256 leaves no room for the prompt in data.max_seq_len=256"),
    ("data.format=alpaca", "task: grpo generates from prompt rows; set data.format=prompt (got alpaca)"),
    ("task=sft", "data.format: prompt rows train task: grpo or task: distill; set task (now sft)"),
    ("data.packing=true", "data.packing: prompt rows are not packed"),
    ("data.train_on_prompt=true", "data.train_on_prompt: their tasks learn from generated completions only"),
    ("eval.metrics=[token_accuracy]", "eval.metrics: 'token_accuracy' is not a task grpo metric; use one of "
                                      "['exact_match']"),
])
def test_a_bad_grpo_setting_is_one_line(grpo_recipe, override: str, needle: str) -> None:
    sections = {"data": {"format": "prompt", "train": "prompts.jsonl", "eval": "prompts.jsonl"}} \
        if override.startswith("eval.") else {}
    line = _one_line(grpo_recipe, [override], **sections)
    assert line.startswith(needle), line


def test_streaming_prompt_rows_is_refused(grpo_recipe) -> None:
    assert _one_line(grpo_recipe, ["data.streaming=true"]).startswith(
        "data.streaming: true cannot run task grpo")


def test_grpo_needs_a_causal_lm_that_generates(grpo_recipe) -> None:
    line = _lines(grpo_recipe, ["model.type=bert"])[0]
    assert line.startswith("task: grpo trains a causal LM on its own generated text, but bert is a classification "
                           "model"), line


def test_a_reward_model_folder_must_exist_and_hold_a_model(grpo_recipe, tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    assert _one_line(grpo_recipe, grpo={"rewards": [{"reward_model": missing}]}) == \
        f"grpo.rewards[0].reward_model: folder not found: {missing} (give a task: reward run's final/ folder)"
    (tmp_path / "empty").mkdir()
    assert "holds no config.json" in _one_line(grpo_recipe, grpo={"rewards": [{"reward_model": str(tmp_path /
                                                                                                   "empty")}]})
    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "final" / "config.json").write_text("{}")
    cfg = grpo_recipe(grpo={"rewards": [{"reward_model": str(tmp_path / "run")}]})
    assert cfg.grpo.rewards[0].metric == "reward_model"


def test_a_relative_reward_model_path_is_stored_absolute(grpo_recipe, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "runs" / "rm" / "final").mkdir(parents=True)
    (tmp_path / "runs" / "rm" / "final" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    cfg = grpo_recipe(grpo={"rewards": [{"reward_model": "runs/rm/final"}]})
    assert cfg.grpo.rewards[0].reward_model == str((tmp_path / "runs" / "rm" / "final").resolve())


def test_the_other_tasks_ignore_the_grpo_section(write_recipe, minimal_recipe) -> None:
    cfg = load_recipe(write_recipe({**minimal_recipe, "grpo": {"group_size": 3}}), [])[0]
    assert cfg.task is None and cfg.grpo.group_size == 3 and cfg.grpo.rewards == []


def test_the_keys_reach_the_json_schema_and_the_key_list() -> None:
    keys = _all_keys(RecipeConfig)
    assert {"grpo.group_size", "grpo.max_new_tokens", "grpo.temperature", "grpo.top_p", "grpo.beta", "grpo.epsilon",
            "grpo.iterations", "grpo.loss", "grpo.rewards"} <= set(keys)
    schema = recipe_file_schema()
    validator = jsonschema.Draft202012Validator(schema)
    good = {"task": "grpo", "data": {"format": "prompt"},
            "grpo": {"rewards": [{"exact_match": True}, {"regex": "a", "weight": 0.5, "name": "a"},
                                 {"function": "m:f"}, {"reward_model": "runs/rm/final"}]}}
    assert not list(validator.iter_errors(good))
    assert list(validator.iter_errors({"grpo": {"rewards": [{"regx": "a"}]}}))
    assert list(validator.iter_errors({"grpo": {"loss": "seq"}}))
    assert "prompts" in schema["$defs"]["TrainConfig"]["properties"]["global_batch_size"]["description"]


def test_a_function_reward_whose_package_is_missing_is_one_line(grpo_recipe) -> None:
    line = _one_line(grpo_recipe, grpo={"rewards": [{"function": "no_such_reward_pkg.scores:f"}]})
    assert line == "grpo.rewards[0].function: package 'no_such_reward_pkg' is not installed or not on the Python " \
                   "path (for 'no_such_reward_pkg.scores:f')"
