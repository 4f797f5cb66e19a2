"""Exact resume for every task, on its shipped recipe made small: a run stopped by SIGTERM after step 3 (it saves a
checkpoint at step 4) and resumed equals the straight run bit for bit: the exported tensors, and every logged step,
loss, gradient norm and reward. Each step accumulates 2 micro-steps and dropout is on where the task keeps it, so
the restored data cursor, RNG states, optimizer and schedule all matter; DPO's resumed process scores its reference
with the initial model before the checkpoint loads, and GRPO regenerates its batch from the restored seeds. One
test for every task: a task added later gets its case here (and its shipped recipe), not a copy of the test.
Variants of one task (fp16, packing with workers, a SIGKILL, a mixture, a stream, GRPO's iterations and KL) stay
with that task's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import cli_exit_code, run_stopped_after, small_recipes, with_sections, write_named

pytestmark = pytest.mark.integration

STEPS = 6
# case -> the shipped recipe it starts from, and what the case changes
DROPOUT = {"config_overrides": {"attention_dropout": 0.1}}  # tiny-llama's attention dropout: the RNG matters
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sft": ("quickstart", {"model": DROPOUT}),
    "lora": ("lora-quickstart", {"model": DROPOUT, "peft": {"dropout": 0.1}}),
    "classification": ("minilm-classification", {}),  # BERT's dropout is on in its config
    # dpo and reward turn dropout off by default (train.dropout: null): here it stays on
    "dpo": ("dpo-quickstart", {"model": DROPOUT, "train": {"dropout": True}}),
    "reward": ("dpo-quickstart", {"task": "reward", "dpo": None, "model": DROPOUT, "train": {"dropout": True}}),
    # a reward that random completions sometimes earn: exact_match alone is 0 for a small random model (no gradient)
    "grpo": ("grpo-quickstart", {"grpo": {"rewards": [{"regex": "[aeiou]"}]}}),
    "vision": ("vlm-quickstart", {}),
    # chat rows with tools and tool calls (rendered one by one with their tools, the format read from the columns)
    "tools": ("tools-quickstart", {"model": DROPOUT}),
    # on-policy distillation from a random student, half its steps sampled (lmbda 0.5): the resumed process
    # rebuilds the teacher, decides each step and draws each completion from the same seeds
    "distill": ("distill-quickstart", {"model": {**DROPOUT, "path": None},
                                       "distill": {"lmbda": 0.5, "max_new_tokens": 4, "teacher": "TEACHER"}}),
}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_recipes(tmp_path_factory.mktemp("shipped"), {})


def _exported(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's export (a full model, or a LoRA adapter)."""
    files = sorted((run / "final").glob("*.safetensors"))
    assert files, f"{run}/final holds no weights"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}


def _steps(run: Path) -> list[tuple[int, float, float, float | None]]:
    """Each train row's step, loss, gradient norm and (GRPO) mean reward."""
    return [(r["step"], r["loss"], r["grad_norm"], r.get("reward")) for r in read_metrics(run) if r["kind"] == "train"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_stopped_and_resumed_run_equals_the_straight_run(case: str, recipes: Path, tmp_path: Path) -> None:
    shipped, changes = CASES[case]
    if "distill" in changes:  # a teacher folder of the student's tokenizer, made for the case
        from tests.integration.test_distill import make_teacher

        teacher = str(make_teacher(tmp_path / "teacher"))
        changes = {**changes, "distill": {**changes["distill"], "teacher": teacher}}
    recipe = yaml.safe_load((recipes / f"{shipped}.yaml").read_text())
    for split in ("train", "eval"):  # the small recipe's data, wherever the runs are written
        recipe["data"][split] = str(recipes / recipe["data"][split])
    recipe = with_sections(recipe, **{key: value for key, value in changes.items() if value is not None})
    for key in [key for key, value in changes.items() if value is None]:
        recipe.pop(key, None)
    recipe = with_sections(recipe, data={"eval": None}, eval={"metrics": [], "every_steps": None, "at_start": False},
                           train={"micro_batch_size": 2, "global_batch_size": 4, "max_steps": STEPS},
                           checkpoint={"every_steps": 2, "keep_last": 5, "save_final": True},
                           logging={"every_steps": 1})
    assert cli_exit_code("run", str(write_named(tmp_path, "straight", recipe))) == 0
    run_stopped_after(write_named(tmp_path, "resumed", recipe), 3)
    resumed = tmp_path / "resumed"
    assert (resumed / "checkpoints" / "step-000004").is_dir() and not (resumed / "final").exists()
    assert cli_exit_code("resume", str(resumed)) == 0

    straight = tmp_path / "straight"
    assert _steps(resumed) == _steps(straight) and [s[0] for s in _steps(straight)] == list(range(1, STEPS + 1))
    a, b = _exported(straight), _exported(resumed)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert any(s[2] > 0 for s in _steps(straight))  # the run really trained (a GRPO step of equal rewards has none)
