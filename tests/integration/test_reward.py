"""`task: reward` end to end on tiny-llama, one process: it learns, its export is a Hugging Face reward model that
scores what the trained model scored, `finetune eval` works on the run, a checkpoint and the export, accumulation
is pair-weighted (8x1 = 2x4 = 1x8), resume is bit-identical, and LoRA trains the head with the adapter.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune import hooks
from finetune.storage.metrics import read_metrics
from tests.integration.conftest import (
    cli_exit_code,
    final_weights,
    max_rel_diff,
    tiny_recipe,
    with_sections,
    write_named,
)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
GOOD, BAD = "abcdefghijklm", "nopqrstuvwxyz"


def preference_rows(count: int, seed: int) -> list[dict[str, str]]:
    """Pairs whose chosen answer is made of letters a-m and whose rejected one of n-z, of unrelated random lengths
    (so micro-batches differ in padding, and length alone tells nothing)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        letters = " ".join(rng.choice(GOOD + BAD) for _ in range(rng.randint(2, 5)))
        rows.append({"prompt": f"Answer with letters after: {letters}",
                     "chosen": " ".join(rng.choice(GOOD) for _ in range(rng.randint(1, 9))),
                     "rejected": " ".join(rng.choice(BAD) for _ in range(rng.randint(1, 9)))})
    return rows


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small preference train set (96 pairs) and eval set (41 pairs: not a multiple of any batch size)."""
    root = tmp_path_factory.mktemp("pref")
    files = {}
    for split, count, seed in (("train", 96, 0), ("eval", 41, 1)):
        files[split] = root / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in preference_rows(count, seed)))
    return files


def reward_recipe(files: dict[str, Path], name: str = "reward", **sections: Any) -> dict[str, Any]:
    """tiny-llama as a reward model on ``files`` (train, eval): micro 4 x accum 2, eval of preference accuracy at
    the end."""
    recipe = tiny_recipe(
        name=name, task="reward",
        data={"format": "preference", "train": str(files["train"]), "eval": str(files["eval"]), "max_seq_len": 64},
        eval={"metrics": ["preference_accuracy"], "batch_size": 16},
    )
    return with_sections(recipe, **sections)


def run(folder: Path, recipe: dict[str, Any], *args: str) -> Path:
    """``finetune run`` in this process; the run dir."""
    assert cli_exit_code("run", str(write_named(folder, recipe["name"], recipe)), *args) == 0
    return folder / recipe["name"]


def evals(run_dir: Path) -> list[dict[str, Any]]:
    rows = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert not any("eval_ppl" in r for r in rows)  # a per-pair loss has no perplexity
    return rows


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_reward_model_learns_the_preferences(tmp_path: Path, pref_data: dict[str, Path]) -> None:
    """From chance to clearly better within 12 steps, over all 41 eval pairs. Measured (train.seed 7, 1, 2, 3):
    accuracy 0.24-0.73, loss 0.68-0.70 and mean margin -0.02-0.03 at the start; accuracy 0.93-1.0, loss 0.14-0.28
    and mean margin 1.5-2.3 after 12 steps.

    The letters cue is deliberate: the shipped reverse_pref pairs (right vs wrong reversal) need the score to compare
    answer and prompt, which a randomly initialised tiny-llama does not learn in a short run (measured: 0.55-0.58
    after 60 steps of 32 pairs, loss flat at 0.693); a wrong pairing, swapped halves or a score read at padding
    cannot learn this cue either."""
    recipe = reward_recipe(pref_data, train={"max_steps": 12}, eval={"at_start": True, "every_steps": 6})
    rows = evals(run(tmp_path, recipe))
    first, last = rows[0], rows[-1]
    assert first["eval_preference_accuracy_total"] == last["eval_preference_accuracy_total"] == 41
    assert first["eval_samples"] == 41  # pairs, not sequences
    assert last["eval_preference_accuracy"] >= 0.8, rows
    assert last["eval_loss"] < 0.45 < first["eval_loss"], rows
    assert last["eval_reward_margin"] > first["eval_reward_margin"] + 1.0, rows


SCORE_SCRIPT = """
import json, sys
import torch, transformers
folder, batch = sys.argv[1], json.loads(sys.argv[2])
model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
with torch.no_grad():
    out = model(input_ids=torch.tensor(batch["input_ids"]), attention_mask=torch.tensor(batch["attention_mask"]))
print(json.dumps({"scores": out.logits.squeeze(-1).tolist(), "class": type(model).__name__,
                  "labels": model.config.num_labels}))
"""


def test_export_scores_what_the_trained_model_scored(tmp_path: Path, pref_data: dict[str, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """final/ loads with AutoModelForSequenceClassification in a fresh process and gives the live model's scores
    on an eval batch; `finetune eval` of the run, its last checkpoint and final/ reproduce the last in-training eval
    and print eval_preference_accuracy."""
    from finetune.commands.evaluate import evaluate_target

    seen: dict[str, Any] = {}

    def capture(trainer: Any) -> None:
        if trainer.state.step == trainer.ctx.max_steps:
            batch = next(iter(trainer.task.build_dataloader("eval")))
            trainer.model.eval()
            with torch.no_grad():
                out = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            trainer.model.train()
            seen.update(batch={k: batch[k].tolist() for k in ("input_ids", "attention_mask")},
                        pairs=batch["pairs"], scores=out.logits.float().squeeze(-1).tolist())

    hooks.register("after_step", capture)
    recipe = reward_recipe(pref_data, train={"max_steps": 6}, checkpoint={"every_steps": 3})
    run_dir = run(tmp_path, recipe)
    assert seen["pairs"] == 16 and len(seen["scores"]) == 32
    done = subprocess.run([sys.executable, "-c", SCORE_SCRIPT, str(run_dir / "final"), json.dumps(seen["batch"])],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert loaded["class"] == "LlamaForSequenceClassification" and loaded["labels"] == 1
    assert loaded["scores"] == pytest.approx(seen["scores"], rel=1e-5, abs=1e-6)

    last = evals(run_dir)[-1]
    for target in (run_dir, run_dir / "final", run_dir / "checkpoints" / "step-000006"):
        got = evaluate_target(target, [])
        assert got["eval_preference_accuracy_total"] == 41
        assert got["eval_preference_accuracy_correct"] == last["eval_preference_accuracy_correct"]
        assert got["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    capsys.readouterr()
    assert cli_exit_code("eval", str(run_dir)) == 0
    assert "eval_preference_accuracy" in capsys.readouterr().out


def test_a_reward_model_trains_with_dropout_off(tmp_path: Path, pref_data: dict[str, Path]) -> None:
    """task reward trains with dropout off (train.dropout null), as TRL's reward trainer does: a model whose config
    has attention dropout trains exactly as the same model without it (weights and losses bit for bit); with
    train.dropout true it does not."""
    common = {"data": {"eval": None}, "eval": {"metrics": []}, "train": {"max_steps": 2}}
    dropping = {"type": "tiny-llama", "config_overrides": {"attention_dropout": 0.1}}
    plain = run(tmp_path, reward_recipe(pref_data, name="plain", **common))
    off = run(tmp_path, reward_recipe(pref_data, name="off", model=dropping, **common))
    on = run(tmp_path, reward_recipe(pref_data, name="on", model=dropping,
                                     **{**common, "train": {"max_steps": 2, "dropout": True}}))
    assert losses(off) == losses(plain) and max_rel_diff(final_weights(off), final_weights(plain)) == 0
    assert losses(on)[0] != losses(plain)[0]


def test_accumulation_is_pair_weighted(tmp_path: Path, pref_data: dict[str, Path]) -> None:
    """micro 8 x accum 1, 2 x 4 and 1 x 8 give the same weights (<= 1e-5): the loss is a sum over pairs, divided
    once by the window's pairs, and no score depends on the padding of its micro-batch. SGD passes gradients through
    linearly, so this is the accumulation math itself (a per-micro-batch mean instead of a sum: 1.2 apart)."""
    weights = {}
    for micro in (8, 2, 1):
        recipe = reward_recipe(pref_data, name=f"acc{micro}", optim={"name": "sgd", "lr": 0.5, "momentum": 0.9},
                               data={"eval": None}, eval={"metrics": []},
                               train={"micro_batch_size": micro, "global_batch_size": 8, "max_steps": 3})
        weights[micro] = final_weights(run(tmp_path, recipe))
    assert max_rel_diff(weights[8], weights[2]) <= 1e-5
    assert max_rel_diff(weights[8], weights[1]) <= 1e-5


def test_micro_batches_carry_different_padding(pref_data: dict[str, Path]) -> None:
    """The invariance above means something only if micro-batches of one step differ in length, so that a
    token-weighted (rather than pair-weighted) division would give different weights."""
    from finetune.config import RecipeConfig
    from finetune.data import load_splits
    from finetune.registry import get_model
    from finetune.runtime.modeling import build_tokenizer
    from finetune.tasks import build_task

    cfg = RecipeConfig.model_validate(reward_recipe(pref_data, train={"micro_batch_size": 2}))
    row = get_model("tiny-llama", "reward")
    tokenizer = build_tokenizer(cfg.model, row)
    task = build_task(cfg, row, tokenizer, load_splits(cfg.data, tokenizer), 0, 1)
    batches = iter(task.build_dataloader("train"))
    tokens = [int(next(batches)["attention_mask"].sum()) for _ in range(4)]
    assert len(set(tokens)) > 1, tokens


def test_lora_trains_the_head_and_evaluates(tmp_path: Path, pref_data: dict[str, Path]) -> None:
    """A LoRA reward run saves the adapter with the full score head; `finetune eval` of it (adapter on the seeded
    base) reproduces the last in-training eval."""
    from safetensors.torch import load_file

    from finetune.commands.evaluate import evaluate_target

    recipe = reward_recipe(pref_data, name="lora", peft={"method": "lora", "preset": "attn"}, optim={"lr": 5e-3},
                           train={"max_steps": 6})
    run_dir = run(tmp_path, recipe)
    adapter = load_file(str(run_dir / "final" / "adapter_model.safetensors"))
    assert any(".score." in k for k in adapter) and any("lora_A" in k for k in adapter)
    assert json.loads((run_dir / "final" / "adapter_config.json").read_text())["modules_to_save"] == ["score"]
    last = evals(run_dir)[-1]
    got = evaluate_target(run_dir, [])
    assert got["eval_preference_accuracy_correct"] == last["eval_preference_accuracy_correct"]
    assert got["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
