"""The tiny Qwen2-VL row on 2 CPU processes (gloo) gives the 1-process numbers, resumes exactly, and its LoRA
adapter exports and merges.

DDP, FSDP2 (decoder layers and vision blocks wrapped, parameters really sharded) and ZeRO-3: per-step losses, the
exported weights and the eval (loss, token accuracy and exact_match, which generates with the images in lockstep
on sharded backends) match one process within 1e-4. ZeRO-3 stopped by SIGTERM resumes bit-identically. A LoRA run
under FSDP2 exports an adapter on the language model only, which `finetune merge` turns into a verified model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.distributed.test_backends import _assert_really_distributed, _finetune, _run, run_ok
from tests.integration.conftest import final_weights, max_rel_diff
from tests.integration.test_vlm import final_state, image_prompts, shapes_copy, vlm_recipe
from tests.recipe_files import write_recipe_file

pytestmark = [pytest.mark.distributed, pytest.mark.extended]  # make test-all, not make test (CI time)
TWO = ("--num-processes", "2")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``recipe.yaml``: 8 steps of global batch 8 (micro 4), no dropout, evals at steps 4 and 8, a checkpoint every
    4 steps; ``lora.yaml``: the same with LoRA (attn_mlp) and no evals.

    The data is mixed: every other row is text-only, in training (with this seed some micro-batches hold no image
    at all) and in the eval set (rank 1's stride of it is all text). Every rank must still run the vision tower on
    every forward, or the ranks' collectives no longer match (without the collator's placeholder image, these runs
    abort in their first step: checked by hand on ddp, fsdp2 and zero3)."""
    root = tmp_path_factory.mktemp("dist-vlm")
    data = {"train": shapes_copy(root, "train", 128, text_every=2), "eval": shapes_copy(root, "eval", 12, text_every=2)}
    recipe = vlm_recipe(root, model={"config_overrides": {}}, data=data,
                        checkpoint={"every_steps": 4, "keep_last": 3})
    write_recipe_file(root / "recipe.yaml", recipe)
    lora = vlm_recipe(root, model={"config_overrides": {}}, peft={"method": "lora", "preset": "attn_mlp"},
                      optim={"lr": 1.0e-2}, eval={"every_steps": None}, checkpoint={"every_steps": None})
    write_recipe_file(root / "lora.yaml", lora)
    return root


@pytest.fixture(scope="module")
def vlm_reference(vlm_dir: Path) -> Path:
    return run_ok(vlm_dir, "single")


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def _evals(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r["kind"] == "eval"]


_straight: dict[str, Path] = {}


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero3"])
def test_parity_with_one_process(vlm_dir: Path, vlm_reference: Path, backend: str) -> None:
    run = _straight[backend] = run_ok(vlm_dir, backend, "--accelerate-config", backend, *TWO)
    _assert_really_distributed(run, backend, vlm_reference)
    assert len(_losses(run)) == 8
    assert _losses(run) == pytest.approx(_losses(vlm_reference), rel=1e-4)
    # under module names: a sharded backend's export keeps them on disk, one process writes the hub's key names
    ours, theirs = final_state(run), final_state(vlm_reference)
    # a key bias shifts every key of a query alike, which softmax ignores: its gradient is zero up to rounding,
    # and Adam scales that rounding noise to full-size steps, so it is held to an absolute bound, not a relative one
    noise = [k for k in ours if k.endswith("k_proj.bias")]
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in noise) <= 1e-5
    assert max_rel_diff({k: ours[k] for k in ours if k not in noise},
                        {k: theirs[k] for k in theirs if k not in noise}) <= 1e-4
    ours, theirs = _evals(run), _evals(vlm_reference)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [4, 8]
    for a, b in zip(ours, theirs, strict=True):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-4)
        for key in ("eval_token_accuracy_total", "eval_token_accuracy_correct", "eval_exact_match_total",
                    "eval_exact_match_correct"):
            assert a[key] == b[key], key


def test_zero3_resume_equals_straight(vlm_dir: Path) -> None:
    """SIGTERM on rank 0 after step 3: a checkpoint at step 4, and the resumed run ends bit-identical."""
    straight = _straight.get("zero3") or run_ok(vlm_dir, "zero3", "--accelerate-config", "zero3", *TWO)
    run, done = _run(vlm_dir, "zero3-resumed", "--accelerate-config", "zero3", *TWO, FINETUNE_TERM_AT_STEP="3")
    assert done.returncode != 0 and (run / "checkpoints" / "step-000004").is_dir()
    resumed = _finetune("resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = final_weights(straight), final_weights(run)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert _losses(run) == _losses(straight)


def test_lora_under_fsdp2_exports_the_language_adapter_and_merges(vlm_dir: Path) -> None:
    from safetensors.torch import load_file

    done = _finetune("run", str(vlm_dir / "lora.yaml"), "-o", str(vlm_dir / "lora"), "--accelerate-config", "fsdp2",
                     *TWO)
    assert done.returncode == 0, done.stderr[-3000:]
    adapter = load_file(str(vlm_dir / "lora" / "final" / "adapter_model.safetensors"))
    assert adapter and not any("visual" in k for k in adapter) and any("mlp.down_proj" in k for k in adapter)
    merged = _finetune("merge", str(vlm_dir / "lora"), "-o", str(vlm_dir / "merged"))
    assert merged.returncode == 0, merged.stderr[-3000:]
    done = _finetune("eval", str(vlm_dir / "merged"), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["eval_total"] == 12


def test_generate_with_images_on_two_processes_writes_the_one_process_file(vlm_dir: Path, vlm_reference: Path,
                                                                           tmp_path: Path) -> None:
    """`finetune generate --num-processes 2` on the VLM (image prompts, a text-only chat and a raw prompt, sampled)
    writes the bytes one process writes: each rank's share sampled prompt by prompt from its own seed."""
    prompts = image_prompts(tmp_path)
    flags = ["--max-new-tokens", "6", "--temperature", "0.9", "--seed", "5", "--batch-size", "4"]
    one = _finetune("generate", str(vlm_reference), str(prompts), "-o", str(tmp_path / "one.jsonl"), *flags)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _finetune("generate", str(vlm_reference), str(prompts), "-o", str(tmp_path / "two.jsonl"), *flags, *TWO,
                    "--accelerate-config", "ddp")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "on 2 process(es)" in two.stdout
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
