"""The reward functions of task grpo: each built-in's semantics, the weighted total (one line naming the rewards when
it is not finite), the plugin import gate (a stored run's function is imported only with --trust-remote-code), one
line naming the function for a bad plugin result or an exit it asks for, a plugin as a guest (its own copy of the
rows, its prints on stderr), and the reward_model reward scoring as the reward model scores a text alone."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from finetune.config.schema import GRPOConfig
from finetune.errors import ConfigError
from finetune.registry import SUPPORTED_MODELS
from finetune.tasks.rewards import RewardError, RewardFunctions, build_rewards

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"
PLUGIN = '''
from pathlib import Path
Path(__file__).with_name("imported").write_text("yes")

def length(prompts, completions, rows):
    return [len(c) for c in completions]

def short(prompts, completions, rows):
    return [1.0] * (len(completions) - 1)

def nan(prompts, completions, rows):
    return [float("nan")] * len(completions)

def text(prompts, completions, rows):
    return ["1"] * len(completions)

def mixed(prompts, completions, rows):
    import numpy, torch
    return [1, True, numpy.float32(0.5), torch.tensor(2.0)][:len(completions)]

def as_tensor(prompts, completions, rows):
    import torch
    return torch.arange(len(completions), dtype=torch.float64)

def boom(prompts, completions, rows):
    raise KeyError("level")

def exits(prompts, completions, rows):
    import sys
    sys.exit(0)

def exits_with_text(prompts, completions, rows):
    raise SystemExit("no more")

def interrupts(prompts, completions, rows):
    raise KeyboardInterrupt

def takes_answers(prompts, completions, rows):
    for row in rows:
        row.pop("answer")
    return [0.0] * len(completions)

def huge(prompts, completions, rows):
    return [1e308] * len(completions)

def chatty(prompts, completions, rows):
    print("scoring", len(completions))
    return [0.0] * len(completions)
'''
EXITS_ON_IMPORT = "import sys\nsys.exit(3)\n"


def cfg_of(*rewards: dict[str, Any]) -> Any:
    """The one field of a recipe that build_rewards reads."""
    return type("Recipe", (), {"grpo": GRPOConfig(rewards=list(rewards))})()


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package ``grpo_reward_plugin`` on sys.path (fresh per test, so its import side effect shows)."""
    package = tmp_path / "grpo_reward_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(PLUGIN)
    (package / "exiting.py").write_text(EXITS_ON_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("grpo_reward_plugin")]:
        monkeypatch.delitem(sys.modules, name)
    return package


def test_exact_match_strips_and_compares_as_text() -> None:
    rewards = build_rewards(cfg_of({"exact_match": True}), device="cpu", allow_plugin=False)
    rows = [{"answer": "4"}, {"answer": 6}, {"answer": " 12 "}, {"answer": "4"}]
    scores = rewards.score(["p"] * 4, [" 4\n", "6", "12", "40"], rows)
    assert rewards.names == ("exact_match",) and scores == [[1.0, 1.0, 1.0, 0.0]]


def test_regex_searches_anywhere_and_the_total_is_weighted() -> None:
    rewards = build_rewards(cfg_of({"regex": r"\d+$", "weight": 0.5}, {"regex": "^<a>", "name": "tag", "weight": 2},
                                   {"exact_match": True, "weight": -1}), device="cpu", allow_plugin=False)
    completions = ["x 42", "<a>b", "<a>7", "7x"]
    scores = rewards.score(["p"] * 4, completions, [{"answer": "7x"}] * 4)
    assert rewards.names == ("regex", "tag", "exact_match") and rewards.weights == (0.5, 2.0, -1.0)
    assert scores == [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    assert rewards.total(scores) == [0.5, 2.0, 2.5, -1.0]


def test_a_plugin_function_is_imported_only_when_allowed(plugin_dir: Path) -> None:
    cfg = cfg_of({"function": "grpo_reward_plugin.scores:length", "weight": 0.1})
    with pytest.raises(ConfigError) as info:
        build_rewards(cfg, device="cpu", allow_plugin=False)
    assert str(info.value).startswith("grpo.rewards[0].function: the run's recipe names the reward function "
                                      "'grpo_reward_plugin.scores:length'") and "--trust-remote-code" in str(info.value)
    assert not (plugin_dir / "imported").exists()  # refused before anything ran
    rewards = build_rewards(cfg, device="cpu", allow_plugin=True)
    assert (plugin_dir / "imported").exists()
    assert rewards.names == ("length",) and rewards.score(["p", "p"], ["ab", "abcd"], [{}, {}]) == [[2.0, 4.0]]
    assert rewards.total([[2.0, 4.0]]) == [pytest.approx(0.2), pytest.approx(0.4)]


@pytest.mark.parametrize(("function", "needle"), [
    ("short", "reward short: returned 1 values for 2 completions (one per completion)"),
    ("nan", "reward nan: value 0 is nan, not a finite number"),
    ("text", "reward text: value 0 is '1' (str), not a number"),
    ("boom", "reward grpo_reward_plugin.scores:boom: raised KeyError: 'level'"),
])
def test_a_bad_plugin_result_stops_with_one_line_naming_it(plugin_dir: Path, function: str, needle: str) -> None:
    rewards = build_rewards(cfg_of({"function": f"grpo_reward_plugin.scores:{function}"}), device="cpu",
                            allow_plugin=True)
    with pytest.raises(RewardError) as info:
        rewards.score(["p", "p"], ["a", "b"], [{}, {}])
    assert str(info.value) == needle


@pytest.mark.parametrize(("function", "detail"), [
    ("exits", "called sys.exit(0)"),  # exit 0 would have ended the run as if done, with no model
    ("exits_with_text", "called sys.exit('no more')"),
    ("interrupts", "raised KeyboardInterrupt itself (no Ctrl+C was pressed)"),
])
def test_an_exit_a_plugin_asks_for_is_a_failure_naming_it(plugin_dir: Path, function: str, detail: str) -> None:
    rewards = build_rewards(cfg_of({"function": f"grpo_reward_plugin.scores:{function}"}), device="cpu",
                            allow_plugin=True)
    with pytest.raises(RewardError) as info:
        rewards.score(["p", "p"], ["a", "b"], [{}, {}])
    message = str(info.value)
    assert message.startswith(f"reward grpo_reward_plugin.scores:{function}: {detail}") and "\n" not in message


def test_a_module_that_exits_on_import_is_one_line(plugin_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^grpo.rewards\[0\].function: importing 'grpo_reward_plugin.exiting': "
                                          r"called sys.exit\(3\)[^\n]*$"):
        build_rewards(cfg_of({"function": "grpo_reward_plugin.exiting:f"}), device="cpu", allow_plugin=True)


def test_a_plugin_that_changes_its_rows_changes_nothing_else(plugin_dir: Path) -> None:
    """Each function gets its own copy of the rows: exact_match, after it, still reads every answer, and so does
    the trainer afterwards."""
    rewards = build_rewards(cfg_of({"function": "grpo_reward_plugin.scores:takes_answers"}, {"exact_match": True}),
                            device="cpu", allow_plugin=True)
    rows = [{"answer": "4"}, {"answer": "5"}]
    assert rewards.score(["p", "p"], ["4", "6"], rows) == [[0.0, 0.0], [1.0, 0.0]]
    assert rows == [{"answer": "4"}, {"answer": "5"}]


def test_a_total_that_overflows_is_one_line_naming_the_rewards(plugin_dir: Path) -> None:
    rewards = build_rewards(cfg_of({"function": "grpo_reward_plugin.scores:huge", "name": "a"},
                                   {"function": "grpo_reward_plugin.scores:huge", "name": "b"}), device="cpu",
                            allow_plugin=True)
    scores = rewards.score(["p"], ["x"], [{}])  # each score is finite: only their sum is not
    with pytest.raises(RewardError, match=r"^rewards a, b: the total of completion 0 is not a finite number "
                                          r"\(a 1e\+308 x 1 \+ b 1e\+308 x 1\); [^\n]*$"):
        rewards.total(scores)


def test_what_a_plugin_prints_goes_to_stderr(plugin_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """stdout is finetune's (``finetune eval --json`` prints one JSON object there)."""
    rewards = build_rewards(cfg_of({"function": "grpo_reward_plugin.scores:chatty"}), device="cpu",
                            allow_plugin=True)
    capsys.readouterr()
    rewards.score(["p", "p"], ["a", "b"], [{}, {}])
    out, err = capsys.readouterr()
    assert out == "" and err == "scoring 2\n"


def test_a_plugin_may_return_any_real_numbers(plugin_dir: Path) -> None:
    rewards = build_rewards(cfg_of({"function": "grpo_reward_plugin.scores:mixed"},
                                   {"function": "grpo_reward_plugin.scores:as_tensor"}), device="cpu",
                            allow_plugin=True)
    scores = rewards.score(["p"] * 4, ["a"] * 4, [{}] * 4)
    assert scores == [[1.0, 1.0, 0.5, 2.0], [0.0, 1.0, 2.0, 3.0]]
    assert all(type(v) is float for column in scores for v in column)


def test_a_plugin_that_cannot_be_imported_is_one_line(plugin_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^grpo.rewards\[0\].function: module 'grpo_reward_plugin.scores' has no "
                                          r"function 'missing'$"):
        build_rewards(cfg_of({"function": "grpo_reward_plugin.scores:missing"}), device="cpu", allow_plugin=True)
    with pytest.raises(ConfigError, match=r"^grpo.rewards\[0\].function: cannot import 'no_such_module_here' "
                                          r"\(ModuleNotFoundError"):
        build_rewards(cfg_of({"function": "no_such_module_here:f"}), device="cpu", allow_plugin=True)


def save_reward_model(folder: Path) -> tuple[Any, Any]:
    """A tiny LlamaForSequenceClassification (one output, the tokenizer's pad id) saved as a task: reward export
    is: config.json + model.safetensors + the tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))
    config = transformers.LlamaConfig(**SUPPORTED_MODELS["llama"].tiny_config, num_labels=1,
                                      pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                      else tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config).eval()
    model.save_pretrained(folder)  # safetensors
    tokenizer.save_pretrained(folder)
    return model, tokenizer


# (the reward run's recipe in its final/ folder, whether the prompts are chat renders, what goes before the text):
# a folder finetune did not write, or a run of data.add_bos auto, takes a text as the tokenizer's own call does and a
# chat template's render as it is; a run trained before data.add_bos existed (its recipe lacks it) put bos first
RULES = [(None, False, "own"), ("name: rm\ndata: {add_bos: auto}\n", True, "none"),
         ("name: rm\ndata: {format: preference}\n", True, "bos")]


@pytest.mark.parametrize(("recipe", "templated", "first"), RULES)
def test_a_reward_model_scores_prompt_plus_completion_as_alone(tmp_path: Path, recipe: str | None, templated: bool,
                                                               first: str) -> None:
    model, tokenizer = save_reward_model(tmp_path / "rm" / "final")
    (tmp_path / "rm" / "recipe.resolved.yaml").write_text("name: rm\n")  # the run's: the final/ folder's is read
    if recipe is not None:
        (tmp_path / "rm" / "final" / "recipe.resolved.yaml").write_text(recipe)
    lines: list[str] = []
    rewards = build_rewards(cfg_of({"reward_model": str(tmp_path / "rm")}), device="cpu", log=lines.append,
                            allow_plugin=False)
    assert rewards.names == ("reward_model",) and len(lines) == 1 and "LlamaForSequenceClassification" in lines[0]
    prompts_ = ["Q: 2+2=", "Q: say hello at length ="] * 5  # 10 texts: two batches, padded
    completions = ["4", "hello hello hello hello", "5", "hi", "", "x", "4 ", "hello", "four", "h e l l o"]
    scores = rewards.score(prompts_, completions, [{}] * 10, [templated] * 10)[0]
    expected = []
    for prompt, completion in zip(prompts_, completions, strict=True):
        text = prompt + completion
        ids = {"own": tokenizer(text)["input_ids"], "none": tokenizer(text, add_special_tokens=False)["input_ids"],
               "bos": [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]}[first]
        ids = [*ids, tokenizer.eos_token_id]
        with torch.no_grad():
            expected.append(float(model(input_ids=torch.tensor([ids])).logits.reshape(())))
    assert all(math.isfinite(s) for s in scores)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) > 1  # the texts score differently: the model read them


def test_a_reward_model_folder_that_is_not_one_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match=r"^grpo.rewards\[0\].reward_model: .* is not a task: reward export \(no "
                                          r"config.json\) \(it holds a LoRA adapter: merge it first"):
        build_rewards(cfg_of({"reward_model": str(tmp_path / "adapter")}), device="cpu", allow_plugin=False)


def test_reward_functions_check_lengths_of_their_inputs() -> None:
    rewards = RewardFunctions(["a"], [1.0], [lambda p, c, r: [0.0] * len(c)])
    assert rewards.score(["p"], ["c"], [{}]) == [[0.0]] and rewards.total([[0.0]]) == [0.0]
