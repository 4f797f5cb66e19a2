"""task: distill end to end on tiny models: accumulation invariance (offline, and on-policy with a mix of sampled and
data steps), on-policy answers that are never a target, held-out learning of the teacher's distribution, the train
and eval metrics (the teacher's log-prob of the student's completions against the teacher's own forward), and a bad
teacher refused in one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import (
    cli_exit_code,
    final_weights,
    max_rel_diff,
    new_trainer,
    tiny_recipe,
    write_named,
)

pytestmark = pytest.mark.integration

ASSET = Path(__file__).resolve().parents[2] / "finetune" / "assets" / "tiny-llama-tokenizer"
DATA = Path(__file__).resolve().parents[2] / "recipes" / "data"


def make_teacher(folder: Path, seed: int = 123, **overrides: Any) -> Path:
    """A tiny llama (the tiny-llama row's config, ``overrides`` on top, its own seed) saved as a teacher folder: its
    config.json, model.safetensors and the bundled tokenizer."""
    import transformers

    from finetune.registry import SUPPORTED_MODELS

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**dict(SUPPORTED_MODELS["tiny-llama"].tiny_config), **overrides})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(ASSET)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_teacher(tmp_path_factory.mktemp("teacher") / "model", hidden_size=96, intermediate_size=192)


def distill_recipe(teacher: Path, **sections: Any) -> dict[str, Any]:
    """A tiny-llama student distilled from ``teacher`` on the reverse data, SGD (accumulation checks need no Adam)."""
    sections = {"optim": {"name": "sgd", "lr": 0.5}, "scheduler": {"name": "constant", "warmup_steps": 0}, **sections,
                "distill": {"teacher": str(teacher), **sections.get("distill", {})}}
    return tiny_recipe(task="distill", **sections)


def _steps(trainer: Any, steps: int) -> list[tuple[float, dict[str, float]]]:
    from finetune.runtime.loop import train_step

    batches = iter(trainer.task.build_dataloader("train"))
    trainer.model.train()
    out = []
    for _ in range(steps):
        stats = train_step(trainer, [next(batches) for _ in range(trainer.ctx.cfg.grad_accum)])
        out.append((stats.loss, stats.extra))
    trainer.tracker.close()
    return out


@pytest.mark.parametrize("distill", [
    {"mode": "offline", "loss": "jsd", "beta": 0.3, "alpha": 0.25, "top_k": 16, "temperature": 1.5},
    {"mode": "on_policy", "loss": "reverse_kl", "lmbda": 0.5, "max_new_tokens": 4},
], ids=["offline", "on_policy"])
def test_accumulation_invariance(tmp_path: Path, teacher: Path, distill: dict[str, Any]) -> None:
    """8 rows per step as micro 8 x accum 1, 2 x 4 and 1 x 8 give the same weights (SGD, <= 1e-6) and losses: the
    loss is summed over target tokens and divided once over the window; on-policy completions are drawn per row
    from (seed, step, position) and a step is on-policy or not for every micro-batch alike."""
    from finetune.config import load_recipe

    weights, rows = {}, {}
    for micro in (8, 2, 1):
        recipe = distill_recipe(teacher, distill=distill,
                                train={"micro_batch_size": micro, "global_batch_size": 8, "max_steps": 4})
        cfg, _ = load_recipe(write_named(tmp_path, f"acc{micro}", recipe))
        trainer = new_trainer(cfg)
        rows[micro] = _steps(trainer, 4)
        weights[micro] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for micro in (2, 1):
        assert max_rel_diff(weights[8], weights[micro]) <= 1e-6
        for (a, ea), (b, eb) in zip(rows[8], rows[micro], strict=True):
            assert b == pytest.approx(a, rel=1e-5)
            assert eb.keys() == ea.keys() and [eb[k] for k in eb] == pytest.approx([ea[k] for k in ea], rel=1e-5)
    assert all(extra["divergence"] > 0 for _, extra in rows[8])
    if distill["mode"] == "on_policy":  # lmbda 0.5: both kinds of step occur in 4 steps of seed 7
        sampled = ["completion_len" in extra for _, extra in rows[8]]
        assert any(sampled) and not all(sampled), sampled


def test_on_policy_answers_are_never_targets_and_metrics_are_the_teachers(tmp_path: Path, teacher: Path) -> None:
    """distill.lmbda 1: training on rows whose answers are scrambled gives the same weights bit for bit (only the
    prompts are read); the train row's teacher_logprob is the teacher's own mean log-prob of the sampled completion
    tokens (its forward on them, scored here with plain log_softmax), and completion_len their mean length."""
    from finetune.config import load_recipe

    rows = [json.loads(line) for line in (DATA / "reverse_train.jsonl").read_text().splitlines()[:64]]
    plain, scrambled = tmp_path / "plain.jsonl", tmp_path / "scrambled.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scrambled.write_text("".join(json.dumps({**r, "output": "x " * (i % 5 + 1)}) + "\n" for i, r in enumerate(rows)))
    runs = {}
    for name, data in (("plain", plain), ("scrambled", scrambled)):
        recipe = distill_recipe(teacher, distill={"mode": "on_policy", "max_new_tokens": 5},
                                data={"train": str(data), "eval": None},
                                train={"micro_batch_size": 4, "global_batch_size": 4, "max_steps": 2})
        cfg, _ = load_recipe(write_named(tmp_path, name, recipe))
        trainer = new_trainer(cfg)
        if name == "plain":  # the first step's batch, scored by the teacher itself
            batch = next(iter(trainer.task.build_dataloader("train")))
            with torch.no_grad():
                logits = trainer.task.teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                              position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0),
                                              use_cache=False).logits.float()
            targets = batch["labels"][:, 1:]
            picked = logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            expected = picked[targets != -100].mean().item()
            completions = (targets != -100).sum(1).float().mean().item()
        runs[name] = (_steps(trainer, 2), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    (a, wa), (b, wb) = runs["plain"], runs["scrambled"]
    assert a == b and all(torch.equal(wa[k], wb[k]) for k in wa)
    first = a[0][1]
    assert first["teacher_logprob"] == pytest.approx(expected, rel=1e-5)
    assert first["completion_len"] == pytest.approx(completions)


def test_the_student_learns_the_teacher_on_held_out_rows(tmp_path: Path, teacher: Path) -> None:
    """Offline forward KL, 24 Adam steps: the held-out divergence to the teacher falls by more than half and the
    student's held-out loss moves towards the teacher's; the eval row holds the teacher's loss, constant."""
    recipe = distill_recipe(teacher, optim={"name": "adamw", "lr": 3e-3},
                            train={"micro_batch_size": 8, "global_batch_size": 8, "max_steps": 24},
                            eval={"every_steps": 24, "at_start": True, "metrics": ["token_accuracy"], "batch_size": 50})
    assert cli_exit_code("run", str(write_named(tmp_path, "learn", recipe))) == 0
    evals = [r for r in read_metrics(tmp_path / "learn") if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    assert last["eval_divergence"] < 0.5 * first["eval_divergence"]
    assert abs(last["eval_loss"] - last["eval_teacher_loss"]) < abs(first["eval_loss"] - first["eval_teacher_loss"])
    assert last["eval_teacher_loss"] == pytest.approx(first["eval_teacher_loss"], rel=1e-6)
    assert (tmp_path / "learn" / "final" / "config.json").is_file()
    assert final_weights(tmp_path / "learn")  # the student is exported, never the teacher


def _bad(tmp_path: Path, what: str) -> tuple[dict[str, Any], str]:
    """A recipe with one thing wrong about its teacher, and the words its one line must hold."""
    folder = tmp_path / what
    if what == "missing":
        return distill_recipe(folder), "folder not found"
    if what == "no-teacher":
        recipe = distill_recipe(folder)
        recipe["distill"].pop("teacher")
        return recipe, "task distill needs a teacher"
    make_teacher(folder)
    if what == "code":
        (folder / "modeling_evil.py").write_text("raise SystemExit('ran')\n")
        return distill_recipe(folder), "holds model code (modeling_evil.py)"
    if what == "pickles":
        (folder / "pytorch_model.bin").write_bytes(b"not read")
        return distill_recipe(folder), "pickled weights (pytorch_model.bin)"
    if what == "vocabulary":
        vocab = json.loads((folder / "tokenizer.json").read_text())
        model = vocab["model"]["vocab"]
        a, b = sorted(model, key=model.get)[40:42]
        model[a], model[b] = model[b], model[a]
        (folder / "tokenizer.json").write_text(json.dumps(vocab))
        return distill_recipe(folder), "another vocabulary than the student"
    assert what == "head-size"
    make_teacher(folder, vocab_size=640)
    return distill_recipe(folder), "the teacher's head has 640 outputs, the student's 512"


@pytest.mark.parametrize("what", ["missing", "no-teacher", "code", "pickles", "vocabulary", "head-size"])
def test_a_bad_teacher_is_one_line_and_nothing_runs(tmp_path: Path, what: str, capsys: pytest.CaptureFixture) -> None:
    recipe, words = _bad(tmp_path, what)
    assert cli_exit_code("run", str(write_named(tmp_path, "bad", recipe))) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert not (tmp_path / "bad" / "checkpoints").exists() and not (tmp_path / "bad" / "final").exists()


def test_lora_self_distillation_uses_the_students_base_with_the_adapter_off(tmp_path: Path, teacher: Path) -> None:
    """A LoRA student whose distill.teacher is its own model.path: the teacher is the student with its adapter
    disabled (no second model is loaded: the log says so, and the plan counts no teacher), so at the first step (the
    adapter's B is zero) student and teacher are the same model and the divergence is 0; the cross-entropy mix then
    moves the adapter away, and the divergence with it."""
    from finetune.config import load_recipe
    from finetune.runtime.plan import build_plan

    recipe = distill_recipe(teacher, model={"type": "llama", "path": str(teacher)},
                            peft={"method": "lora", "r": 4, "alpha": 8},
                            distill={"alpha": 0.5}, optim={"name": "adamw", "lr": 1e-2},
                            train={"micro_batch_size": 4, "global_batch_size": 4, "max_steps": 4},
                            data={"eval": None})
    path = write_named(tmp_path, "self", recipe)
    cfg, _ = load_recipe(path)
    assert not [item for item in build_plan(cfg, devices=[]).items if item.key.startswith("teacher_")]
    assert cli_exit_code("run", str(path)) == 0
    assert "the student's base with its adapter disabled" in (tmp_path / "self" / "train.log").read_text()
    divergences = [r["divergence"] for r in read_metrics(tmp_path / "self") if r["kind"] == "train"]
    assert divergences[0] == pytest.approx(0.0, abs=1e-6) and divergences[-1] > 1e-4, divergences


def test_prompt_rows_train_on_policy_and_evaluate_from_their_prompts(tmp_path: Path, teacher: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """Prompt rows (GRPO's: no answers) distil on-policy at every step; their eval is the student's greedy
    completions: exact_match against each row's answer (no eval loss) and the divergence on those completions.
    Prompt rows that would train offline, or an eval metric that needs answers, are one line each."""
    from tests.integration.test_grpo import prompt_file

    rows = prompt_file(tmp_path, rows=12)
    recipe = distill_recipe(teacher, data={"format": "prompt", "train": str(rows), "eval": str(rows),
                                           "max_seq_len": 32},
                            distill={"mode": "on_policy", "max_new_tokens": 4},
                            train={"micro_batch_size": 4, "global_batch_size": 4, "max_steps": 3},
                            eval={"every_steps": 3, "at_start": False, "metrics": ["exact_match"], "batch_size": 5})
    assert cli_exit_code("run", str(write_named(tmp_path, "prompts", recipe))) == 0
    metrics = read_metrics(tmp_path / "prompts")
    train = [r for r in metrics if r["kind"] == "train"]
    assert len(train) == 3 and all(r["completion_len"] > 0 and r["divergence"] > 0 for r in train)
    last = [r for r in metrics if r["kind"] == "eval"][-1]
    assert "eval_loss" not in last and last["eval_exact_match_total"] == 12 and last["eval_divergence"] > 0

    for changes, words in (({"distill": {"mode": "offline"}}, "set distill.mode=on_policy and distill.lmbda=1"),
                           ({"eval": {"metrics": ["token_accuracy"]}}, "token_accuracy needs the rows' answers")):
        bad = distill_recipe(teacher, data={"format": "prompt", "train": str(rows), "eval": str(rows)},
                             **{**{"distill": {"mode": "on_policy"}}, **changes})
        capsys.readouterr()
        assert cli_exit_code("config", str(write_named(tmp_path, "bad", bad))) == 2, words
        assert words in capsys.readouterr().err
