"""task: dpo on one process: it trains through the shared loop with pair-weighted accumulation, resumes bit for bit,
works with LoRA (whose reference is the base with the adapter disabled), is evaluated again by `finetune eval`, and
the shipped DPO quickstart (a short SFT, then DPO) learns what docs/tasks/dpo.md promises.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import (
    DATA,
    REPO,
    final_weights,
    max_rel_diff,
    new_trainer,
    run_in_process,
    tiny_recipe,
    with_sections,
)

pytestmark = pytest.mark.integration
TRAIN_PAIRS, EVAL_PAIRS = 96, 40  # the first rows of the bundled pair files (the reference pass scores them all)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Path]:
    """Small train / eval pair files cut from the bundled reverse-letters pairs."""
    root = tmp_path_factory.mktemp("pairs")
    out = {}
    for split, rows in (("train", TRAIN_PAIRS), ("eval", EVAL_PAIRS)):
        lines = (DATA / f"reverse_pref_{split}.jsonl").read_text().splitlines()[:rows]
        out[split] = root / f"{split}.jsonl"
        out[split].write_text("\n".join(lines) + "\n")
    return out


def dpo_recipe(pairs: dict[str, Path], **sections: Any) -> dict[str, Any]:
    """tiny_recipe on the small pair files, as task: dpo with preference accuracy."""
    recipe = tiny_recipe(
        data={"format": "preference", "train": str(pairs["train"]), "eval": str(pairs["eval"]), "max_seq_len": 64},
        eval={"metrics": ["preference_accuracy"], "batch_size": 16},
    )
    recipe["task"] = "dpo"
    return with_sections(recipe, **sections)


def _rows(run: Path, kind: str) -> list[dict]:
    rows = [r for r in read_metrics(run) if r["kind"] == kind]
    assert kind != "eval" or not any("eval_ppl" in r for r in rows)  # a per-pair loss has no perplexity
    return rows


def test_dpo_trains_from_log2_and_finetune_eval_reproduces_its_eval(train_recipe, pairs) -> None:
    """At step 0 the policy IS the reference: every pair costs exactly log 2 and none is won (h = 0, ties lose),
    on a model whose config has dropout too: DPO trains with dropout off (train.dropout null), as the DPO paper's
    code and TRL do. Training lowers the loss and wins pairs; `finetune eval` recomputes the reference and the same
    numbers. Control: with train.dropout true the first step's policy is not the reference."""
    from finetune.commands.evaluate import evaluate_target

    dropping = {"type": "tiny-llama", "config_overrides": {"attention_dropout": 0.1}}
    run = train_recipe(dpo_recipe(pairs, model=dropping, eval={"at_start": True, "every_steps": 8},
                                  train={"max_steps": 8}))
    kept = train_recipe(dpo_recipe(pairs, name="dropout-kept", model=dropping, data={"eval": None},
                                   eval={"metrics": []}, train={"max_steps": 1, "dropout": True}))
    assert abs(_rows(kept, "train")[0]["loss"] - math.log(2)) > 1e-3
    evals, train = _rows(run, "eval"), _rows(run, "train")
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and first["eval_loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert first["eval_preference_accuracy_correct"] == 0 and first["eval_reward_margin"] == 0
    assert first["eval_samples"] == first["eval_preference_accuracy_total"] == EVAL_PAIRS
    assert train[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)  # the first step starts at the reference too
    assert "train.dropout: false: 0 dropout module(s) and 2 attention dropout rate(s) set to 0" in \
        (run / "train.log").read_text()
    assert last["eval_loss"] < math.log(2) and last["eval_preference_accuracy_correct"] > 0
    assert last["eval_reward_margin"] > 0
    assert last["eval_logps_chosen"] < 0 and last["eval_logps_rejected"] < 0
    log = (run / "train.log").read_text()
    assert "reference log-probs: scoring 136 pairs (96 train, 40 eval) with the initial model ..." in log
    assert "reference log-probs: 136 pairs in" in log

    again = evaluate_target(run, [])
    assert again["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    assert again["eval_preference_accuracy_correct"] == last["eval_preference_accuracy_correct"]
    assert again["eval_reward_margin"] == pytest.approx(last["eval_reward_margin"], rel=1e-5)


def test_pair_weighted_accumulation_invariance(train_recipe, pairs) -> None:
    """micro 8 x accum 1, 2 x 4 and 1 x 8 pairs give the same weights (<= 1e-5) and losses: each micro-batch
    returns the SUM of its pair losses and the loop divides the window's sum by its pair count once (only the
    padding differs). SGD passes gradients through linearly, so this is the accumulation math itself; AdamW would
    also normalise the near-cancelling chosen/rejected gradient entries, whose rounding then shows at ~2e-4."""
    weights, losses = {}, {}
    for micro in (8, 2, 1):
        run = train_recipe(dpo_recipe(pairs, name=f"dpo-acc{micro}", optim={"name": "sgd", "lr": 0.5, "momentum": 0.9},
                                      data={"eval": None}, eval={"metrics": []},
                                      train={"micro_batch_size": micro, "global_batch_size": 8, "max_steps": 3}))
        weights[micro], losses[micro] = final_weights(run), [r["loss"] for r in _rows(run, "train")]
    for micro in (2, 1):
        assert max_rel_diff(weights[8], weights[micro]) <= 1e-5
        assert losses[micro] == pytest.approx(losses[8], rel=1e-5)
    assert losses[8][-1] != losses[8][0]  # the steps really trained
    assert [r["tokens"] for r in _rows(run, "train")] == [8, 16, 24]  # a target is a pair


def test_lora_dpo_scores_the_reference_with_the_adapter_disabled(write_run_recipe, pairs) -> None:
    """With a LoRA adapter that is far from zero (as after a resume), the reference pass still gives the base
    model's log-probs: the adapter is disabled. Control: the same model with its adapter on scores differently."""
    from finetune.config import load_recipe
    from finetune.data.batching import PreferenceCollator
    from finetune.tasks.dpo import compute_reference, policy_logps

    cfg, _ = load_recipe(write_run_recipe(dpo_recipe(pairs, name="lora-ref", peft={"method": "lora", "dropout": 0.0})))
    trainer = new_trainer(cfg)
    try:
        before = torch.tensor(trainer.task.data.eval.dataset["ref_logps"])
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.5)
        compute_reference(trainer.task, trainer.model, trainer.ctx.accelerator, trainer.precision, lambda _: None)
        after = torch.tensor(trainer.task.data.eval.dataset["ref_logps"])
        assert torch.equal(before, after)
        rows = [trainer.task.data.eval.dataset[i] for i in range(4)]
        trainer.model.eval()
        with torch.no_grad():
            adapted = policy_logps(trainer.model, PreferenceCollator(0)(rows))[0]
        assert not torch.allclose(adapted[:4], after[:4, 0], rtol=1e-3)
    finally:
        trainer.tracker.close()


def test_lora_dpo_trains_and_exports_an_adapter(train_recipe, pairs) -> None:
    from finetune.commands.evaluate import evaluate_target

    run = train_recipe(dpo_recipe(pairs, name="lora-dpo", peft={"method": "lora", "dropout": 0.0},
                                  optim={"lr": 5e-3}, train={"max_steps": 6}))
    evals = _rows(run, "eval")
    assert evals[-1]["eval_loss"] < math.log(2)
    assert (run / "final" / "adapter_model.safetensors").is_file()
    again = evaluate_target(run, [])  # the adapter export: its reference is the base with the adapter off
    assert again["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)


def test_dpo_quickstart_from_a_short_sft_reaches_0_9(tmp_path: Path) -> None:
    """The two commands of recipes/dpo-quickstart.yaml's header (checkpoints off): a short SFT quickstart, then DPO
    from its export. Step 0 wins no pair (the policy is the reference); the end wins >= 90% of the 200 eval pairs."""
    from finetune.config import load_recipe

    sft, _ = load_recipe(REPO / "recipes" / "quickstart.yaml",
                         [f"output_dir={tmp_path / 'sft'}", "train.max_steps=300", "checkpoint.every_steps=null",
                          "eval.every_steps=null", "eval.at_start=false", "eval.metrics=[]"])
    run_in_process(sft)
    dpo, _ = load_recipe(REPO / "recipes" / "dpo-quickstart.yaml",
                         [f"output_dir={tmp_path / 'dpo'}", f"model.path={tmp_path / 'sft' / 'final'}",
                          "checkpoint.every_steps=null"])
    run_in_process(dpo)
    evals = _rows(tmp_path / "dpo", "eval")
    assert evals[0]["step"] == 0 and evals[0]["eval_preference_accuracy"] == 0.0
    assert evals[-1]["eval_preference_accuracy"] >= 0.9 and evals[-1]["eval_preference_accuracy_total"] == 200


def test_dpo_on_a_mixture_of_preference_sources(train_recipe, pairs, tmp_path: Path) -> None:
    """data.train as a weighted list of preference sources: every source is tokenized as pairs, scored by the
    reference pass and mixed by the same cursor (weights 1 and 0.5: an epoch is 96 + 24 pairs)."""
    half = tmp_path / "half.jsonl"
    half.write_text("\n".join(pairs["train"].read_text().splitlines()[:48]) + "\n")
    recipe = dpo_recipe(pairs, train={"max_steps": 3}, checkpoint={"every_steps": None})
    recipe["data"]["train"] = [{"path": str(pairs["train"])}, {"path": str(half), "weight": 0.5}]
    run = train_recipe(recipe)
    train = _rows(run, "train")
    assert len(train) == 3 and all(math.isfinite(r["loss"]) for r in train)
    assert train[-1]["tokens"] == 3 * 8  # a target is a pair: 8 pairs a step
    assert (run / "final" / "model.safetensors").is_file()
