"""The fingerprints of what defines a run's objective besides its recipe (finetune.storage.objective): a reward
model's weights, a reward function's source file (found without importing it), the reference model; a change to any
of them is one resume line naming its key, and a checkpoint from before these fingerprints resumes with a note."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from finetune.config.schema import RecipeConfig
from finetune.storage import objective
from finetune.storage.resume import objective_changes

PACKAGE = "objective_probe_rewards"  # a name no installed package has
TRAIN = {"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 4}


def recipe(task: str | None = "grpo", beta: float = 0.05, peft: str = "none", **model: Any) -> RecipeConfig:
    """A recipe of ``task`` (schema only: no file is read) with a base model folder; grpo's rewards are a regex, a
    function of :data:`PACKAGE` and a reward model."""
    data = {"grpo": {"format": "prompt"}, "dpo": {"format": "preference"}}.get(task or "", {"format": "alpaca"})
    return RecipeConfig.model_validate({
        "name": "x", "task": task, "train": TRAIN, "peft": {"method": peft},
        "model": {"type": "tiny-llama", **model}, "data": {**data, "train": "train.jsonl"},
        "grpo": {"beta": beta, "rewards": [{"regex": "^a"}, {"function": f"{PACKAGE}.scores:length"},
                                           {"reward_model": "RM"}]}})


@pytest.fixture
def objective_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RecipeConfig:
    """A grpo recipe (beta > 0) whose files exist under ``tmp_path``: the base model ``base/``, the reward model run
    ``rm/`` (its final/ folder), and the package of the reward function on sys.path, whose import would write
    ``IMPORTED``."""
    for folder in (tmp_path / "base", tmp_path / "rm" / "final"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"model_type": "llama"}')
        (folder / "model.safetensors").write_bytes(b"weights")
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w').close()\n")
    (package / "scores.py").write_text("def length(prompts, completions, rows):\n    return [len(c) for c in "
                                       "completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = recipe(path=str(tmp_path / "base"))
    cfg.grpo.rewards[2].reward_model = str(tmp_path / "rm")
    return cfg


@pytest.mark.parametrize(("changed", "key", "what"), [
    ("rm/final/model.safetensors", "grpo.rewards[2].reward_model", "the weights of {root}/rm"),
    ("rm/final/config.json", "grpo.rewards[2].reward_model", "the weights of {root}/rm"),
    (f"{PACKAGE}/scores.py", "grpo.rewards[1].function",
     f"the source file of {PACKAGE}.scores:length ({{root}}/{PACKAGE}/scores.py)"),
    ("base/model.safetensors", "model.path", "the weights of {root}/base"),
])
def test_a_changed_file_is_one_line_naming_its_key(objective_files: RecipeConfig, tmp_path: Path, changed: str,
                                                   key: str, what: str) -> None:
    cfg = objective_files
    stored = objective.fingerprints(cfg)
    assert set(stored) == {"grpo.rewards[1].function", "grpo.rewards[2].reward_model", "model.path"}
    assert all(stored.values()) and objective.changes(cfg, stored, "step-000004") == []
    (tmp_path / changed).write_bytes((tmp_path / changed).read_bytes() + b" ")
    now = objective.fingerprints(cfg)[key]
    assert objective.changes(cfg, stored, "step-000004") == [
        f"{key}: {what.format(root=tmp_path)} changed since step-000004 (sha256 {stored[key][:12]} -> {now[:12]})"]
    assert not (tmp_path / "IMPORTED").exists() and PACKAGE not in sys.modules  # found, never imported


@pytest.mark.parametrize(("task", "beta", "peft", "reference"), [
    (None, 0.0, "none", False),  # the checkpoint holds the whole model: model.path is not read again
    (None, 0.0, "lora", True),  # the base the adapter adds to
    ("dpo", 0.0, "none", True),
    ("grpo", 0.0, "none", False),  # no KL term: no reference
    ("grpo", 0.05, "none", True),
])
def test_the_reference_is_fingerprinted_where_a_resume_reads_it(task: str | None, beta: float, peft: str,
                                                                reference: bool) -> None:
    assert ("model.path" in objective.fingerprints(recipe(task, beta, peft, path="org/model"))) == reference


def test_a_hub_reference_is_the_revision_the_cache_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert objective.model_fingerprint("org/model") == "name:org/model"
    (tmp_path / "models--org--model" / "refs").mkdir(parents=True)
    (tmp_path / "models--org--model" / "refs" / "main").write_text("0123abcd\n")
    assert objective.model_fingerprint("org/model") == "revision:0123abcd"


def test_a_checkpoint_from_before_the_fingerprints_resumes_with_a_note() -> None:
    lines, notes = objective_changes(recipe(path="org/model"), {"data": {}}, "step-000002")
    assert lines == [] and notes == [
        "step-000002 was written before checkpoints fingerprinted the objective: grpo.rewards[1].function, "
        "grpo.rewards[2].reward_model, model.path not checked for changes since then"]
    assert objective_changes(recipe(None, 0.0), {"data": {}}, "step-000002") == ([], [])  # nothing to check
