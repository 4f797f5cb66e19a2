"""Every forward runs in the training precision: a CPU emulation of flash-attn under bf16 autocast.

flash-attn refuses float32 inputs, so a model with fp32 weights (``model.dtype: float32``) and ``attn_implementation:
flash_attention_2`` runs only inside ``train.mixed_precision: bf16`` autocast. Any forward outside it (the logit
probe of a checkpoint, the LoRA reference of ``final/``, ``finetune eval`` / ``export`` (and its fresh-process
check) / ``merge`` / ``generate``, DPO's reference pass, vision generation) crashes there. The plugin
:mod:`tests.plugins.half_only_attention` registers a CPU kernel with flash-attn's dtype rule; these tests run the
whole life of a run with it under bf16 autocast: train with periodic checkpoints, a SIGTERM checkpoint, resume,
export, eval of the run and of a checkpoint, export of a checkpoint, merge, generate, DPO and a vision-language
model. On the code before the fix the first checkpoint fails (reported as a write failure).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from finetune.storage.metrics import read_metrics
from tests.cli_helpers import main_exit
from tests.integration.conftest import DATA, cli_exit_code, run_stopped_after, tiny_recipe, with_sections, write_named
from tests.plugins import half_only_attention

pytestmark = pytest.mark.integration
PLUGIN = "tests.plugins.half_only_attention"


def half_only(recipe: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """``recipe`` with the half-only attention kernel, fp32 weights and bf16 autocast (plus ``sections``)."""
    model = {**recipe["model"], "plugin": PLUGIN, "dtype": "float32",
             "config_overrides": {**recipe["model"].get("config_overrides", {}),
                                  "_attn_implementation": half_only_attention.NAME}}
    return with_sections(recipe, model=model, train={"mixed_precision": "bf16"}, **sections)


def head(source: Path, folder: Path, rows: int) -> str:
    """The first ``rows`` lines of ``source`` in ``folder`` (a small eval or train file)."""
    out = folder / f"{source.stem}-{rows}.jsonl"
    out.write_text("\n".join(source.read_text().splitlines()[:rows]) + "\n")
    return str(out)


def fp32_refused() -> None:
    """The kernel is live: outside autocast (fp32 weights) it refuses, as flash-attn does."""
    import torch
    import transformers

    from finetune import registry
    from finetune.config.schema import ModelConfig
    from finetune.runtime.modeling import build_model

    cfg = ModelConfig(type="tiny-llama", config_overrides={"_attn_implementation": half_only_attention.NAME})
    model = build_model(cfg, registry.get_model("tiny-llama", None))
    assert isinstance(model, transformers.PreTrainedModel)
    with pytest.raises(RuntimeError, match=half_only_attention.MESSAGE):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.tensor([[1, 2, 3]]))


@pytest.fixture(scope="module")
def half_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run under bf16 autocast with the half-only kernel: stopped by SIGTERM after step 1 (checkpoint
    step-000002), resumed to step 4 (periodic checkpoint step-000003, last step-000004), exported with its merge
    reference, evaluated with exact_match at every checkpoint step."""
    folder = tmp_path_factory.mktemp("precision")
    recipe = half_only(tiny_recipe(
        data={"eval": head(DATA / "reverse_eval.jsonl", folder, 8)},
        train={"max_steps": 4}, peft={"method": "lora"}, optim={"lr": 1.0e-2},
        eval={"every_steps": 2, "metrics": ["exact_match"], "max_new_tokens": 4, "batch_size": 8},
        checkpoint={"every_steps": 3, "keep_last": 3}))
    run_stopped_after(write_named(folder, "lora", recipe), 1)
    assert cli_exit_code("resume", str(folder / "lora"), "--trust-remote-code") == 0
    return folder / "lora"


def test_a_lora_run_checkpoints_resumes_and_exports_under_bf16(half_run: Path) -> None:
    """Checkpoints at the SIGTERM (step 2), periodic (3) and last (4) steps each recorded a probe, final/ holds the
    adapter's merge reference, and every eval ran; the kernel computed in bf16 only and refuses fp32."""
    fp32_refused()
    names = sorted(p.name for p in (half_run / "checkpoints").iterdir())
    assert names == ["step-000002", "step-000003", "step-000004"]
    assert all((half_run / "checkpoints" / name / "probe.safetensors").is_file() for name in names)
    assert (half_run / "final" / "merge_check.safetensors").is_file()
    assert [r["step"] for r in read_metrics(half_run) if r["kind"] == "eval"] == [2, 4]
    assert half_only_attention.CALLS["torch.bfloat16"] > 0 and set(half_only_attention.CALLS) == {"torch.bfloat16"}


def test_eval_export_merge_and_generate_run_in_the_training_precision(half_run: Path, tmp_path: Path, monkeypatch,
                                                                       capsys) -> None:
    """`finetune eval` of the run and of a checkpoint (its export reloaded and checked against the recorded probe),
    `finetune export` of a checkpoint (checked in a fresh process), `finetune merge` and `finetune generate` all
    run their forwards under the recipe's bf16 autocast, and reproduce what training computed."""
    code, out, err = main_exit(monkeypatch, capsys, "eval", str(half_run), "--json", "--trust-remote-code")
    assert code == 0, err
    last = [r for r in read_metrics(half_run) if r["kind"] == "eval"][-1]
    assert json.loads(out)["eval_exact_match_total"] == 8
    assert json.loads(out)["eval_loss"] == pytest.approx(last["eval_loss"], abs=1e-4)
    code, out, err = main_exit(monkeypatch, capsys, "eval", str(half_run / "checkpoints" / "step-000002"), "--json",
                               "--trust-remote-code")
    assert code == 0 and "verified: the export reproduces the recorded logits" in err, err
    code, out, err = main_exit(monkeypatch, capsys, "export", str(half_run), "--from", "step-000003", "-o",
                               str(tmp_path / "exported"), "--trust-remote-code")
    assert code == 0, err
    verified = json.loads((tmp_path / "exported" / "manifest.json").read_text())["verified"]
    assert verified["fresh_process"] and verified["max_abs_logit_delta"] <= verified["tolerance"]
    code, out, err = main_exit(monkeypatch, capsys, "merge", str(half_run), "-o", str(tmp_path / "merged"),
                               "--trust-remote-code")
    assert code == 0 and "merge check passed" in out + err, err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"instruction": "Reverse the letters.", "input": "a b c"}) + "\n")
    code, out, err = main_exit(monkeypatch, capsys, "generate", str(half_run), str(prompts), "-o",
                               str(tmp_path / "out.jsonl"), "--max-new-tokens", "3", "--trust-remote-code")
    assert code == 0, err
    assert json.loads((tmp_path / "out.jsonl").read_text())["finish_reason"] in ("eos", "length")


def test_dpo_scores_its_reference_and_checkpoints_under_bf16(tmp_path: Path, monkeypatch, capsys) -> None:
    """task: dpo: the reference pass, training, the checkpoint probe, the export and `finetune eval` (which scores
    the reference again) all run with the half-only kernel."""
    recipe = half_only(tiny_recipe(
        data={"format": "preference", "train": head(DATA / "reverse_pref_train.jsonl", tmp_path, 16),
              "eval": head(DATA / "reverse_pref_eval.jsonl", tmp_path, 8)},
        eval={"metrics": ["preference_accuracy"], "batch_size": 8, "every_steps": 2},
        train={"max_steps": 2}, checkpoint={"every_steps": 2}), task="dpo")
    assert cli_exit_code("run", str(write_named(tmp_path, "dpo", recipe))) == 0
    code, out, err = main_exit(monkeypatch, capsys, "eval", str(tmp_path / "dpo" / "checkpoints" / "step-000002"),
                               "--json", "--trust-remote-code")
    assert code == 0 and json.loads(out)["eval_preference_accuracy_total"] == 8, err


def test_a_vision_language_run_generates_with_images_under_bf16(tmp_path: Path, monkeypatch, capsys) -> None:
    """tiny-qwen2-vl (vision tower and decoder on the half-only kernel): training, the checkpoint probe, the export,
    exact_match's generation with images and `finetune generate` with an image prompt."""
    shapes = DATA / "shapes"
    rows = [json.loads(line) for line in (shapes / "eval.jsonl").read_text().splitlines()[:4]]
    for row in rows:
        for part in row["messages"][0]["content"]:
            if part["type"] == "image":
                part["image"] = str(shapes / part["image"])
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = half_only(tiny_recipe(
        model={"type": "tiny-qwen2-vl"},
        data={"format": "vision_chat", "train": str(shapes / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
        eval={"every_steps": 2, "metrics": ["exact_match"], "batch_size": 4, "max_new_tokens": 3},
        train={"max_steps": 2}, checkpoint={"every_steps": 2}))
    assert cli_exit_code("run", str(write_named(tmp_path, "vlm", recipe))) == 0
    assert [r["eval_exact_match_total"] for r in read_metrics(tmp_path / "vlm") if r["kind"] == "eval"] == [4]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": rows[0]["messages"][:-1]}) + "\n")
    code, _, err = main_exit(monkeypatch, capsys, "generate", str(tmp_path / "vlm"), str(prompts), "-o",
                             str(tmp_path / "out.jsonl"), "--max-new-tokens", "3", "--trust-remote-code")
    assert code == 0, err
    assert json.loads((tmp_path / "out.jsonl").read_text())["finish_reason"] in ("eos", "length")


def test_the_half_precision_tolerance_says_what_it_allows() -> None:
    """bf16 autocast over fp32 weights is half-precision compute: the probe, export and merge checks accept
    max(0.05, 1/32 of the largest |logit|), and their messages say so; float32 compute stays at 1e-4."""
    from finetune.artifacts import probe
    from finetune.commands import merge

    assert probe.tolerance("float32", "no", "single", False, scale=30.0) == 1e-4
    assert probe.tolerance("float32", "bf16", "ddp", False, scale=0.5) == 5e-2
    assert probe.tolerance("float32", "bf16", "ddp", False, scale=32.0) == 1.0
    assert probe.tolerance("bfloat16", "no", "single", False, 32.0) == merge.tolerance("float32", False, "fp16", 32.0)
    assert "1/32 of the largest |logit|" in merge.tolerance_rule("float32", False, "bf16")
