"""Vision-language SFT on the tiny Qwen2-VL row (data.format vision_chat, the shapes data), one process.

Exact resume after a SIGTERM, ``finetune eval`` of the export reproducing the run's metrics, ``model.freeze``,
LoRA on the language model only with its export and ``finetune merge``, and one-line refusals. The quickstart's
learning is tests/integration/test_quickstart_vlm.py; the 2-process backends are tests/distributed/test_vlm.py.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune import registry
from finetune.config.schema import ModelConfig
from finetune.storage.metrics import read_metrics
from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import (
    DATA,
    cli_exit_code,
    run_stopped_after,
    tiny_recipe,
    with_sections,
    write_named,
)

pytestmark = pytest.mark.integration
SHAPES = DATA / "shapes"


def text_only(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its image parts dropped: every turn's content is its text."""
    return {"messages": [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                          " ".join(p["text"] for p in m["content"] if p["type"] == "text")} for m in row["messages"]]}


def shapes_copy(folder: Path, split: str, rows: int | None = None, text_every: int = 0) -> str:
    """The first ``rows`` shapes rows of ``split`` at ``folder/<split>.jsonl``, with absolute image paths (the file
    lives elsewhere); with ``text_every`` = k, every k-th row from the second on is text-only (mixed data, written
    to ``<split>-mixed.jsonl``)."""
    out = []
    for i, line in enumerate((SHAPES / f"{split}.jsonl").read_text().splitlines()[:rows]):
        row = json.loads(line)
        for part in row["messages"][0]["content"]:
            if part["type"] == "image":
                part["image"] = str(SHAPES / part["image"])
        out.append(json.dumps(text_only(row) if text_every and i % text_every == 1 else row))
    path = folder / f"{split}{'-mixed' if text_every else ''}.jsonl"
    path.write_text("\n".join(out) + "\n")
    return str(path)


def small_eval(folder: Path, rows: int = 12) -> str:
    """The first ``rows`` held-out shapes rows."""
    return shapes_copy(folder, "eval", rows)


def vlm_recipe(folder: Path, **sections: Any) -> dict[str, Any]:
    """tiny_recipe on tiny-qwen2-vl and the shapes data: 8 steps of micro 4 x accum 2, dropout on, exact_match and
    token accuracy at steps 4 and 8, a checkpoint every 2 steps."""
    recipe = tiny_recipe(
        model={"type": "tiny-qwen2-vl", "config_overrides": {"attention_dropout": 0.1}},
        data={"format": "vision_chat", "train": str(SHAPES / "train.jsonl"), "eval": small_eval(folder),
              "max_seq_len": 64},
        optim={"lr": 1.0e-3},
        eval={"every_steps": 4, "metrics": ["exact_match", "token_accuracy"], "batch_size": 8, "max_new_tokens": 8},
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    return with_sections(recipe, **sections)


def final_state(run: Path) -> dict[str, torch.Tensor]:
    """The exported model's state dict under its module names (on disk, transformers writes the hub's key names)."""
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(run / "final").state_dict()


def train_rows(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def vlm_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The straight 8-step run, and the same recipe stopped by SIGTERM after step 3 and resumed to step 8."""
    folder = tmp_path_factory.mktemp("vlm")
    recipe = vlm_recipe(folder)
    assert cli_exit_code("run", str(write_named(folder, "straight", recipe))) == 0
    run_stopped_after(write_named(folder, "resumed", recipe), 3)
    assert cli_exit_code("resume", str(folder / "resumed")) == 0
    return {"straight": folder / "straight", "resumed": folder / "resumed", "folder": folder}


def test_trains_and_resumes_bit_identically(vlm_runs: dict[str, Path]) -> None:
    """8 straight steps == 3 steps, SIGTERM (checkpoint at step 4), resume, 4 more: the same losses and eval
    metrics and bit-identical weights, vision tower included (dropout on, shuffle on, accumulation 2)."""
    straight, resumed = vlm_runs["straight"], vlm_runs["resumed"]
    losses = [r["loss"] for r in train_rows(straight)]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert [r["loss"] for r in train_rows(resumed)] == losses
    evals = [r for r in read_metrics(straight) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8] and evals[-1]["eval_total"] == 12
    assert [r for r in read_metrics(resumed) if r["kind"] == "eval"] == evals
    a, b = final_state(straight), final_state(resumed)
    assert any(k.startswith("model.visual.") for k in a)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_the_export_is_a_hub_style_folder_that_eval_reproduces(vlm_runs: dict[str, Path], monkeypatch, capsys) -> None:
    """final/ holds the weights, config, tokenizer and image processor (it loads like a hub folder, with
    AutoModelForImageTextToText and AutoImageProcessor); `finetune eval` of the run reproduces its last eval."""
    import transformers

    final = vlm_runs["straight"] / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= \
        {p.name for p in final.iterdir()}
    assert type(transformers.AutoModelForImageTextToText.from_pretrained(final)).__name__ == \
        "Qwen2VLForConditionalGeneration"
    assert type(transformers.AutoImageProcessor.from_pretrained(final)).__name__ == "Qwen2VLImageProcessorPil"
    code, stdout, _ = main_exit(monkeypatch, capsys, "eval", str(vlm_runs["straight"]), "--json")
    assert code == 0
    metrics = json.loads(stdout)
    last = [r for r in read_metrics(vlm_runs["straight"]) if r["kind"] == "eval"][-1]
    for key in ("eval_exact_match", "eval_token_accuracy", "eval_total"):
        assert metrics[key] == last[key], key
    assert abs(metrics["eval_loss"] - last["eval_loss"]) < 1e-5


def test_freeze_vision_trains_only_the_projector_and_the_language_model(tmp_path: Path) -> None:
    """model.freeze: [vision] keeps the vision tower's patch embedding and blocks exactly at their initial values,
    while the projector (merger) and the language model train; train.log says how many parameters were frozen."""
    from finetune import registry
    from finetune.config.schema import ModelConfig
    from finetune.runtime.modeling import build_base

    recipe = vlm_recipe(tmp_path, model={"freeze": ["vision"]}, train={"max_steps": 2},
                        eval={"every_steps": None}, checkpoint={"every_steps": None})
    assert cli_exit_code("run", str(write_named(tmp_path, "frozen", recipe))) == 0
    after = final_state(tmp_path / "frozen")
    before = build_base(ModelConfig(type="tiny-qwen2-vl", config_overrides={"attention_dropout": 0.1}),
                        registry.get_model("tiny-qwen2-vl"), seed=7).state_dict()
    vision = [k for k in after if k.startswith(("model.visual.blocks.", "model.visual.patch_embed."))]
    assert vision and all(torch.equal(after[k], before[k]) for k in vision)
    for prefix in ("model.visual.merger.", "model.language_model.layers.0.self_attn.q_proj"):
        assert any(not torch.equal(after[k], before[k]) for k in after if k.startswith(prefix)), prefix
    assert "model.freeze: vision (" in (tmp_path / "frozen" / "train.log").read_text()


def test_lora_adapts_the_language_model_only_and_merges(tmp_path: Path, monkeypatch, capsys) -> None:
    """A LoRA preset on the VLM adapts the decoder's attention and MLP, never the vision tower (whose MLP shares
    names with the decoder's in Qwen2.5-VL); the adapter export evaluates, and `finetune merge` writes a plain
    model that reproduces base + adapter."""
    from safetensors.torch import load_file

    recipe = vlm_recipe(tmp_path, peft={"method": "lora", "preset": "attn_mlp"}, train={"max_steps": 4},
                        optim={"lr": 1.0e-2}, eval={"every_steps": None}, checkpoint={"every_steps": None})
    assert cli_exit_code("run", str(write_named(tmp_path, "lora", recipe))) == 0
    run = tmp_path / "lora"
    adapter = load_file(str(run / "final" / "adapter_model.safetensors"))
    assert adapter and all(".language_model." in k for k in adapter) and not any("visual" in k for k in adapter)
    assert any("mlp.gate_proj" in k for k in adapter)
    code, stdout, err = main_exit(monkeypatch, capsys, "merge", str(run), "-o", str(tmp_path / "merged"))
    assert code == 0, err
    assert (tmp_path / "merged" / "preprocessor_config.json").is_file()
    code, stdout, _ = main_exit(monkeypatch, capsys, "eval", str(tmp_path / "merged"), "--json")
    assert code == 0 and json.loads(stdout)["eval_total"] == 12


HUB_ROWS = sorted(n for n, r in registry.SUPPORTED_MODELS.items() if r.image_token and not r.debug_build)


@pytest.mark.parametrize("name", HUB_ROWS)
def test_every_hub_vision_row_trains_from_a_model_folder(tmp_path: Path, name: str) -> None:
    """Each vision-language row that needs ``model.path`` trains from a hub-style folder (its tiny config's
    weights, the bundled tokenizer and image processor), on mixed data (text-only rows beside image rows), with
    its vision tower frozen as ``model.freeze: [vision]`` asks; eval generates with the images, and final/ loads back
    as the row's own class with its image processor."""
    import transformers

    from finetune.runtime.modeling import build_tokenizer, save_tokenizer

    row = registry.SUPPORTED_MODELS[name]
    hub = tmp_path / "hub"
    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    getattr(transformers, row.auto_class).from_config(config).save_pretrained(hub)
    save_tokenizer(build_tokenizer(ModelConfig(type="tiny-qwen2-vl"), registry.get_model("tiny-qwen2-vl")), hub)
    data = {"train": shapes_copy(tmp_path, "train", 32, text_every=2), "eval": shapes_copy(tmp_path, "eval", 6, 2)}
    recipe = vlm_recipe(tmp_path, model={"type": name, "path": str(hub), "config_overrides": {},
                                         "freeze": ["vision"]}, data=data, train={"max_steps": 2},
                        eval={"every_steps": 2, "batch_size": 4, "max_new_tokens": 4},
                        checkpoint={"every_steps": None})
    assert cli_exit_code("run", str(write_named(tmp_path, "run", recipe))) == 0
    run = tmp_path / "run"
    assert len(train_rows(run)) == 2 and all(math.isfinite(r["loss"]) for r in train_rows(run))
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2] and evals[0]["eval_exact_match_total"] == 6
    before = transformers.AutoModelForImageTextToText.from_pretrained(hub).state_dict()
    after = transformers.AutoModelForImageTextToText.from_pretrained(run / "final")
    assert type(after).__name__ == getattr(transformers, row.config_class).__name__.replace(
        "Config", "ForConditionalGeneration")
    after = after.state_dict()
    tower = [k for k in after if any(k.startswith(p + ".") for p in row.freeze_groups["vision"])]
    assert tower and all(torch.equal(after[k], before[k]) for k in tower)
    assert any(not torch.equal(after[k], before[k]) for k in after if k.startswith("model.language_model."))
    assert transformers.AutoImageProcessor.from_pretrained(run / "final").merge_size == 2


# --- finetune generate with images --------------------------------------------------------------------------------


def image_prompts(folder: Path) -> Path:
    """Prompts for `finetune generate`: held-out shapes questions (absolute image paths), one whose image path is
    relative to the prompts file, one text-only chat, one raw text prompt, and the relative-path question again in
    TRL's form (a bare image part, the path in an ``images`` list); extra keys ride along."""
    import shutil

    rows = [json.loads(line) for line in Path(shapes_copy(folder, "eval", 5)).read_text().splitlines()]
    prompts = [{"id": i, "messages": row["messages"][:-1]} for i, row in enumerate(rows)]
    (folder / "pics").mkdir(exist_ok=True)
    shutil.copy(rows[0]["messages"][0]["content"][0]["image"], folder / "pics" / "mine.png")
    prompts.append({"id": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "image": "pics/mine.png"}, {"type": "text", "text": "Where is the shape?"}]}]})
    prompts += [{"id": 6, "messages": [{"role": "user", "content": "No picture: what colour?"}]},
                {"id": 7, "prompt": "raw text, no image"},
                {"id": 8, "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text":
                                                                    "Where is the shape?"}]}],
                 "images": ["pics/mine.png"]}]  # TRL's form: the path in the row's images list
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def generated(monkeypatch, capsys, run: Path, prompts: Path, out: Path, *flags: str) -> list[dict[str, Any]]:
    code, _, err = main_exit(monkeypatch, capsys, "generate", str(run), str(prompts), "-o", str(out),
                             "--max-new-tokens", "6", *flags)
    assert code == 0, err
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_answers_image_questions_alike_in_any_batch(vlm_runs: dict[str, Path], tmp_path: Path, monkeypatch,
                                                             capsys) -> None:
    """`finetune generate` takes vision_chat prompts (image paths relative to the prompts file), text-only chats
    and raw text: greedy completions do not depend on the batch size, and neither do sampled ones, which follow
    their seed; every input line comes back with its keys, in order."""
    prompts = image_prompts(tmp_path)
    run = vlm_runs["straight"]
    one = generated(monkeypatch, capsys, run, prompts, tmp_path / "one.jsonl", "--batch-size", "1")
    assert [r["id"] for r in one] == list(range(9)) and all(r["finish_reason"] in ("eos", "length") for r in one)
    assert one[8]["completion"] == one[5]["completion"] and one[8]["images"] == ["pics/mine.png"]
    assert one == generated(monkeypatch, capsys, run, prompts, tmp_path / "all.jsonl", "--batch-size", "9")
    sampled = [generated(monkeypatch, capsys, run, prompts, tmp_path / f"s{size}-{seed}.jsonl", "--batch-size", size,
                         "--temperature", "1.5", "--seed", seed) for size, seed in (("1", "3"), ("9", "3"), ("9", "4"))]
    assert sampled[0] == sampled[1] != sampled[2]


@pytest.mark.parametrize("row,message", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "nowhere.png"}]}]},
     "prompts.jsonl:1: image not found: "),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "image", "image": "pics/mine.png"}]}]}, "prompts.jsonl:1: messages[1].content[0] is an image in an "
                                                          "assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]},
     "prompts.jsonl:1: the last message is the assistant's; drop it"),
    ({"prompt": "look: <|image_pad|>"}, "prompts.jsonl:1: the chat template wrote 1 image placeholder(s)"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "pics/mine.png"},
                                                {"type": "text", "text": " then".join(["words"] * 80)}]}]},
     "over data.max_seq_len=64, and keeping its end would cut an image"),
])
def test_generate_refuses_a_bad_image_prompt_in_one_line(vlm_runs: dict[str, Path], tmp_path: Path, monkeypatch, capsys,
                                                         row: dict, message: str) -> None:
    image_prompts(tmp_path)  # pics/mine.png
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(row) + "\n")
    code, out, err = main_exit(monkeypatch, capsys, "generate", str(vlm_runs["straight"]), str(prompts), "-o",
                               str(tmp_path / "out.jsonl"))
    (line,) = assert_user_error(code, out, err)
    assert message in line and not (tmp_path / "out.jsonl").exists()
