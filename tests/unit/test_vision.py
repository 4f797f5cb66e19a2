"""data.format vision_chat: row checks, image-token expansion, masking, over-long cuts and the collator.
(Generation with the images, finetune.tasks.vision_lm: test_vision_lm.py.)"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from finetune import registry
from finetune.config.schema import ModelConfig
from finetune.data.batching import Collator
from finetune.data.formats import Rendered
from finetune.data.loading import load_raw
from finetune.data.tokenize import IGNORE, tokenize_rows
from finetune.data.vision import VisionCollator, expand, fit
from finetune.errors import DataError
from finetune.runtime.modeling import build_tokenizer
from tests.vision_rows import ROW, image, img, qa, text, tokenize, turn, write


def test_only_the_answer_is_trained_and_each_image_is_its_grid_of_tokens(tools, tmp_path: Path) -> None:
    tokenizer, images = tools
    small, wide = image(tmp_path / "a.png"), image(tmp_path / "b.png", "blue", (112, 56))
    rows = [qa(small), {"messages": [turn(img(small), text("and"), img(wide)), {"role": "assistant",
                                                                                "content": "blue"}]}]
    data = tokenize(tools, write(tmp_path, rows)).dataset
    first, second = data[0], data[1]
    assert first["input_ids"].count(images.image_token_id) == 4  # 56x56: 4x4 patches of 14, merged 2x2
    assert second["input_ids"].count(images.image_token_id) == 4 + 8  # 112x56: twice as many
    assert second["image_grids"] == [[1, 4, 4], [1, 4, 8]] and second["n_images"] == 2
    assert [Path(p).name for p in second["images"]] == ["a.png", "b.png"] and Path(second["images"][0]).is_absolute()
    trained = [t for t in first["labels"] if t != IGNORE]
    assert tokenizer.decode(trained) == "red<|im_end|>"
    # the generation prompt holds the same image tokens and ends where the answer starts
    assert first["prompt_ids"] == first["input_ids"][:len(first["prompt_ids"])]
    assert first["prompt_ids"].count(images.image_token_id) == 4 and first["reference"] == "red"


def test_trl_rows_with_an_images_list_tokenize_as_rows_naming_their_paths(tools, tmp_path: Path) -> None:
    """TRL's form, bare {type: image} parts whose paths are the row's ``images`` list in order, gives the same
    tokens, labels and images as parts that name their paths (and rows of both forms share a file)."""
    small, wide = image(tmp_path / "a.png"), image(tmp_path / "b.png", "blue", (112, 56))
    named = {"messages": [turn(img(small), text("and"), img(wide)), {"role": "assistant", "content": "blue"}]}
    bare = {"messages": [turn({"type": "image"}, text("and"), {"type": "image"}),
                         {"role": "assistant", "content": "blue"}], "images": [small, wide]}
    first, second = tokenize(tools, write(tmp_path, [named, bare])).dataset
    for key in ("input_ids", "labels", "prompt_ids", "images", "image_grids", "n_images"):
        assert first[key] == second[key], key


def test_image_tokens_are_not_trained_even_on_the_prompt(tools, tmp_path: Path) -> None:
    _, images = tools
    data = tokenize(tools, write(tmp_path, [qa(image(tmp_path / "a.png"))]), train_on_prompt=True).dataset
    ids, labels = data[0]["input_ids"], data[0]["labels"]
    assert all(label == IGNORE for tid, label in zip(ids, labels, strict=True) if tid == images.image_token_id)
    assert sum(label != IGNORE for label in labels) > 4  # the prompt text is trained on


@pytest.mark.parametrize("bad,message", [
    ({"messages": [turn(img("missing.png"), text("?")), {"role": "assistant", "content": "x"}]},
     "data.jsonl:2: image not found: {tmp}/missing.png"),
    ({"messages": [turn(img("notes.png"), text("?")), {"role": "assistant", "content": "x"}]},
     "data.jsonl:2: cannot read image {tmp}/notes.png"),
    ({"messages": [turn(text("?")), {"role": "assistant", "content": [img("a.png")]}]},
     "data.jsonl:2: messages[1].content[0] is an image in an assistant turn"),
    ({"messages": [turn({"type": "image"}), {"role": "assistant", "content": "x"}]},
     "data.jsonl:2: messages[0].content[0] must be {type: text, text: string} or {type: image, image: path}"),
    ({"messages": [turn({"type": "image"}, text("?")), {"role": "assistant", "content": "x"}],
      "images": ["a.png", "a.png"]}, "data.jsonl:2: the row's 'images' list has 2 path(s) for 1 bare {type: image}"),
    ({"messages": [turn(img("a.png"), {"type": "image"}), {"role": "assistant", "content": "x"}], "images": ["a.png"]},
     "data.jsonl:2: the row's 'images' list has 1 path(s) for 1 bare {type: image} part(s) and 1 part(s) naming"),
    ({"messages": [turn({"type": "image"}), {"role": "assistant", "content": "x"}], "images": "a.png"},
     "data.jsonl:2: field 'images' must be a list of image paths, got 'a.png'"),
    ({"messages": [turn(img("a.png"))]}, "data.jsonl:2: the last message must be the assistant's"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "data.jsonl:2: messages[0] needs role in"),
])
def test_a_bad_row_is_one_line_naming_it(tools, tmp_path: Path, bad: dict, message: str) -> None:
    good = image(tmp_path / "a.png")
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(DataError) as caught:
        tokenize(tools, write(tmp_path, [qa(good), bad]))
    assert message.replace("{tmp}", str(tmp_path)) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_image_the_processor_refuses_is_one_line_in_training_and_in_generate(tools, tmp_path: Path) -> None:
    """A 1x300 strip: Qwen2-VL's processor raises 'absolute aspect ratio must be smaller than 200' (an internal
    error before); tokenizing the data and generate's prompt check both say which line, image and size."""
    from finetune.commands.generate import Prompt, _image_grids

    thin = image(tmp_path / "thin.png", size=(1, 300))
    with pytest.raises(DataError) as caught:
        tokenize(tools, write(tmp_path, [qa(image(tmp_path / "a.png")), qa(thin)]))
    assert "data.jsonl:2: the model's image processor refuses an image" in str(caught.value)
    assert "thin.png is 1x300" in str(caught.value) and "aspect ratio" in str(caught.value)
    images = tools[1]
    prompt = Prompt({}, "prompts.jsonl:1", images=(str(tmp_path / "thin.png"),))
    with pytest.raises(DataError, match=r"prompts.jsonl:1: the model's image processor refuses .* is 1x300"):
        _image_grids(prompt, images.image_token, images)


def test_an_over_long_sample_is_cut_before_an_image_never_inside_it(tools, tmp_path: Path) -> None:
    _, images = tools
    names = [image(tmp_path / f"{i}.png") for i in range(2)]
    row = {"messages": [turn(img(names[0]), text("then"), img(names[1])), {"role": "assistant", "content": "red"}]}
    full = tokenize(tools, write(tmp_path, [row])).dataset[0]["input_ids"]
    second = [i for i, t in enumerate(full) if t == images.image_token_id][4]  # the second image's first token
    for max_len in (second + 1, second + 3):  # inside the second image's 4 tokens (prompt trained: kept)
        cut = tokenize(tools, write(tmp_path, [row]), max_len=max_len, train_on_prompt=True).dataset
        assert cut[0]["input_ids"] == full[:second] and cut[0]["n_images"] == 1, max_len
        assert len(cut[0]["images"]) == 2  # the prompt (generation) keeps both images
        batch = VisionCollator(0, images, with_prompts=True)([cut[0]])
        assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] and batch["pixel_values"].shape[0] == 16
        assert batch["prompt_image_grid_thw"].tolist() == [[1, 4, 4]] * 2
        assert batch["prompt_pixel_values"].shape[0] == 32
    with pytest.raises(DataError, match="no usable samples"):  # cut before any answer token: skipped
        tokenize(tools, write(tmp_path, [row]), max_len=second + 3)


def test_expand_moves_answer_spans_with_the_text() -> None:
    out = expand(Rendered("<i>q<i>:ANS", ((8, 11),), "<i>q<i>:", "ANS", False), "<i>", [3, 2])
    assert out.text == "<i><i><i>q<i><i>:ANS" and out.text[slice(*out.spans[0])] == "ANS"
    assert out.prompt == "<i><i><i>q<i><i>:"


def test_fit_keeps_whole_images() -> None:
    ids = [1, 9, 9, 2, 9, 9, 3]
    assert fit(ids, 9, [2, 2], 10) == (7, 2)
    assert fit(ids, 9, [2, 2], 5) == (4, 1)  # position 5 is inside the second image: cut before it
    assert fit(ids, 9, [2, 2], 4) == (4, 1)
    assert fit(ids, 9, [2, 2], 2) == (1, 0)


def test_the_collator_adds_the_images_the_inputs_hold(tools, tmp_path: Path) -> None:
    tokenizer, images = tools
    names = [image(tmp_path / "a.png"), image(tmp_path / "b.png", "green", (112, 56))]
    source = write(tmp_path, [qa(names[0]), {"messages": [turn(text("no image")), {"role": "assistant",
                                                                                  "content": "ok"}]}, qa(names[1])])
    rows = list(tokenize(tools, source).dataset)
    batch = VisionCollator(tokenizer.pad_token_id, images, with_prompts=True)(rows)
    text_only = Collator(tokenizer.pad_token_id, with_prompts=True)(rows)
    assert torch.equal(batch["input_ids"], text_only["input_ids"]) and torch.equal(batch["labels"], text_only["labels"])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert batch["pixel_values"].shape[0] == 16 + 32  # one row per 14x14 patch
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == images.image_token_id).int())
    assert batch["mm_token_type_ids"].sum(1).tolist() == [4, 0, 8]
    assert torch.equal(batch["prompt_pixel_values"], batch["pixel_values"])
    assert batch["prompt_mm_token_type_ids"].sum(1).tolist() == [4, 0, 8]
    image(tmp_path / "b.png", "green", (56, 56))  # edited after tokenization: its grid no longer fits its tokens
    with pytest.raises(DataError, match=r"b.png changed after the data was tokenized"):
        VisionCollator(tokenizer.pad_token_id, images)(rows)


def test_a_conversation_the_template_would_split_is_one_line(tools, tmp_path: Path) -> None:
    """vision_chat rows are one sample each: a template that renders the last assistant turn unlike an earlier one
    (here: an end token after the last turn only, as Phi-3's) is refused for a two-turn vision row, naming it."""
    import copy

    tokenizer, images = tools
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template += "{%- if not add_generation_prompt %}{{- eos_token }}{%- endif %}"
    source = write(tmp_path, [{"messages": [turn(img(image(tmp_path / "a.png")), text("What colour?")),
                                            {"role": "assistant", "content": "red"}, turn(text("Sure?")),
                                            {"role": "assistant", "content": "yes"}]}])
    with pytest.raises(DataError, match=r"data\.jsonl:1: the chat template renders this conversation's last "
                                        r"assistant turn differently"):
        tokenize((tokenizer, images), source)
    assert len(tokenize((tokenizer, images), source, train_on_prompt=True).dataset) == 1


def test_vision_chat_needs_a_vision_model(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(ModelConfig(type="tiny-qwen2-vl"), ROW)
    source = write(tmp_path, [qa(image(tmp_path / "a.png"))])
    with pytest.raises(DataError, match="vision_chat needs a vision-language model type"):
        tokenize_rows(load_raw(source), fmt="vision_chat", tokenizer=tokenizer, source=source, max_len=64,
                      overlong="truncate", add_bos="auto")


@pytest.mark.parametrize("overrides,message", [
    (["model.freeze=[vison]"], "model.freeze: tiny-qwen2-vl has no part named 'vison'; its parts are vision, "
                               "projector, language"),
    (["model.freeze=[vision,projector,language]"], "leaving nothing to train"),
    (["model.type=tiny-llama", "model.freeze=[vision]", "data.format=alpaca"],
     "model.freeze: tiny-llama has no part named 'vision'; it cannot freeze parts"),
    (["data.packing=true"], "data.packing: tiny-qwen2-vl does not support packing"),
    (["model.type=tiny-llama"], "data.format: 'vision_chat' does not fit tiny-llama (causal_lm)"),
])
def test_the_recipe_refuses_what_the_vision_row_cannot_do(overrides: list[str], message: str) -> None:
    from finetune.config import load_recipe
    from finetune.errors import ConfigError

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "vlm-quickstart.yaml"
    with pytest.raises(ConfigError) as caught:
        load_recipe(recipe, overrides)
    assert message in str(caught.value)


def test_freezing_every_part_is_fine_with_lora() -> None:
    from finetune.config import load_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "vlm-quickstart.yaml"
    cfg, _ = load_recipe(recipe, ["model.freeze=[vision,projector,language]", "peft.method=lora"])
    assert cfg.model.freeze == ["vision", "projector", "language"]


@pytest.mark.parametrize("name", sorted(n for n, r in registry.SUPPORTED_MODELS.items() if r.image_token))
def test_every_vision_row_trains_on_a_collated_batch(tools, tmp_path: Path, name: str) -> None:
    """Each vision-language row's tiny model (its tiny config shares the bundled tokenizer's special ids) takes a
    collated vision_chat batch: finite loss over the answer tokens, gradients reaching its vision tower, and its
    logits depend on the image."""
    import transformers

    from finetune.tasks.logprobs import shifted_loss

    tokenizer, images = tools
    row = registry.SUPPORTED_MODELS[name]
    names = [image(tmp_path / "a.png"), image(tmp_path / "b.png", "blue", (112, 56))]
    rows = list(tokenize(tools, write(tmp_path, [qa(names[0]), qa(names[1], "blue")])).dataset)
    batch = VisionCollator(tokenizer.pad_token_id, images)(rows)
    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    model = getattr(transformers, row.auto_class).from_config(config)
    inputs = {key: batch.get(key) for key in row.model_inputs}
    logits = model(**inputs, use_cache=False).logits
    loss, count, _ = shifted_loss(logits, batch["labels"])
    assert torch.isfinite(loss) and int(count) == sum(t != IGNORE for r in rows for t in r["labels"][1:])
    loss.backward()
    visual = [p.grad for n, p in model.named_parameters() if ".visual." in f".{n}" and p.grad is not None]
    assert visual and any(float(g.abs().sum()) > 0 for g in visual)
    other = dict(inputs, pixel_values=torch.randn_like(batch["pixel_values"]))
    with torch.no_grad():
        assert not torch.allclose(model(**other, use_cache=False).logits, logits.detach())


@pytest.mark.parametrize("name", sorted(n for n, r in registry.SUPPORTED_MODELS.items() if r.image_token))
def test_a_batch_without_images_still_runs_the_vision_tower_and_changes_nothing(tools, tmp_path: Path,
                                                                                 name: str) -> None:
    """A text-only batch gets one blank image in masked extra columns (after the inputs, before the prompts), so
    that every rank of a sharded or DDP run runs the vision tower on every forward: the loss, the logits of the
    real tokens and the greedy completions are those of the plain batch, and the vision weights get a gradient of
    exactly zero (not None: DDP's all-reduce expects one)."""
    import transformers

    from finetune.tasks.logprobs import shifted_loss

    tokenizer, images = tools
    row = registry.SUPPORTED_MODELS[name]
    plain_rows = [{"messages": [turn(text("Say ok")), {"role": "assistant", "content": "ok"}]},
                  {"messages": [turn(text("A longer question, with no image?")), {"role": "assistant",
                                                                                  "content": "fine"}]}]
    rows = list(tokenize(tools, write(tmp_path, plain_rows)).dataset)
    batch = VisionCollator(tokenizer.pad_token_id, images, with_prompts=True)(rows)
    plain = Collator(tokenizer.pad_token_id, with_prompts=True)(rows)
    width, extra = plain["input_ids"].size(1), batch["input_ids"].size(1) - plain["input_ids"].size(1)
    assert extra == images.tokens(batch["image_grid_thw"][0].tolist()) > 0 and len(batch["image_grid_thw"]) == 1
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(batch[key][:, :width], plain[key])
    assert batch["input_ids"][0, width:].eq(images.image_token_id).all() and batch["input_ids"][1, width:].eq(
        tokenizer.pad_token_id).all()
    assert not batch["attention_mask"][:, width:].any() and batch["labels"][:, width:].eq(IGNORE).all()
    assert torch.equal(batch["prompt_ids"][:, extra:], plain["prompt_ids"])
    assert not batch["prompt_mask"][:, :extra].any()
    assert batch["prompt_ids"][0, :extra].eq(images.image_token_id).all()

    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    model = getattr(transformers, row.auto_class).from_config(config)
    with_blank = model(**{key: batch.get(key) for key in row.model_inputs}, use_cache=False).logits
    loss, count, _ = shifted_loss(with_blank, batch["labels"])
    loss.backward()
    visual = [(n, p.grad) for n, p in model.named_parameters() if ".visual." in f".{n}"]
    assert visual and all(g is not None and not g.any() for _, g in visual), [n for n, g in visual if g is None]
    with torch.no_grad():
        without = model(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"], use_cache=False).logits
    real = plain["attention_mask"].bool()
    torch.testing.assert_close(with_blank[:, :width][real], without[real], rtol=1e-5, atol=1e-6)
    expected, expected_count, _ = shifted_loss(without, plain["labels"])
    assert int(count) == int(expected_count) and float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    prompt = {key.removeprefix("prompt_"): batch[key] for key in batch if key.startswith("prompt_")}
    prompt["input_ids"], prompt["attention_mask"] = prompt.pop("ids"), prompt.pop("mask")
    blank_out = model.generate(**prompt, **options)[:, batch["prompt_ids"].size(1):]
    plain_out = model.generate(input_ids=plain["prompt_ids"], attention_mask=plain["prompt_mask"], **options)
    assert torch.equal(blank_out, plain_out[:, plain["prompt_ids"].size(1):])
