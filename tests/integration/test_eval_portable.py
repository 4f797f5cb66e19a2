"""`finetune eval` and `finetune merge` of a run trained elsewhere: the recipe's machine-specific keys (its
launcher, its attention kernel) never stop them, because they run one process and every attention implementation
computes the same function (finetune.commands.evaluate.portable_overrides)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from finetune.commands.evaluate import evaluate_target, portable_overrides
from tests.integration.conftest import REPO, tiny_recipe

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("installed", "cuda", "falls_back"), [(False, False, True), (True, False, True),
                                                             (True, True, False)])
def test_flash_attention_falls_back_only_where_it_cannot_run(monkeypatch, installed: bool, cuda: bool,
                                                             falls_back: bool) -> None:
    import torch

    from finetune.runtime import modeling

    monkeypatch.setattr(modeling, "flash_attn_installed", lambda: installed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    overrides, notes = portable_overrides({"model": {"type": "tiny-llama", "attn_implementation": "flash_attention_2"}})
    assert ("model.attn_implementation=null" in overrides) is falls_back
    assert len(notes) == int(falls_back)
    if falls_back:
        assert "flash_attention_2" in notes[0] and "default attention" in notes[0]
    for attention in ("sdpa", "eager", None):
        assert portable_overrides({"model": {"attn_implementation": attention}})[1] == []


def test_eval_of_a_run_whose_launcher_and_kernel_are_not_on_this_machine(train_recipe, tmp_path: Path,
                                                                         capsys) -> None:
    """Trained with an accelerate config file that is gone now, and evaluated with flash_attention_2 in the recipe
    (an override stands in for a recipe written on a GPU machine: the run's recipe files are hash-verified and
    cannot be edited). Eval still runs, with the model's default attention and the same numbers as the run's last
    in-training eval (the run itself used sdpa, the default)."""
    from finetune.storage.metrics import read_metrics

    custom = tmp_path / "elsewhere" / "my-launcher.yaml"
    custom.parent.mkdir()
    shutil.copy(REPO / "accelerate_configs" / "cpu.yaml", custom)
    run = train_recipe(tiny_recipe(train={"max_steps": 2}, launch={"accelerate_config": str(custom)},
                                   eval={"metrics": ["token_accuracy"], "batch_size": 64}))
    shutil.rmtree(custom.parent)
    assert str(custom) in (run / "final" / "recipe.resolved.yaml").read_text()

    got = evaluate_target(run, ["model.attn_implementation=flash_attention_2"])
    last = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]
    assert got["eval_token_accuracy_correct"] == last["eval_token_accuracy_correct"]
    assert got["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert "flash_attention_2" in capsys.readouterr().err
