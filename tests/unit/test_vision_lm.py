"""finetune.tasks.vision_lm: generation with the prompt's images decodes with finetune's own settings, whatever
generation_config the model folder carries (tiny Qwen2-VL built from its config)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from finetune.data.vision import VisionCollator
from tests.vision_rows import ROW, image, qa, tokenize, write


def test_generation_ignores_the_model_folders_generation_config(tools, tmp_path: Path) -> None:
    """transformers fills every setting a GenerationConfig leaves unset from the model's own generation_config (a
    hub chat model's repetition_penalty, sampling, suppressed tokens): exact_match and `finetune generate` decode
    with their own settings only, and the model keeps its config."""
    import transformers
    from transformers import GenerationConfig

    from finetune.tasks.vision_lm import generate_with_images

    tokenizer, images = tools
    names = [image(tmp_path / "a.png"), image(tmp_path / "b.png", "blue", (112, 56))]
    rows = list(tokenize(tools, write(tmp_path, [qa(names[0]), qa(names[1], "blue")])).dataset)
    batch = VisionCollator(tokenizer.pad_token_id, images, with_prompts=True)(rows)
    torch.manual_seed(0)
    config = getattr(transformers, ROW.config_class)(**copy.deepcopy(dict(ROW.tiny_config)))
    model = getattr(transformers, ROW.auto_class).from_config(config).eval()
    options = {"max_new_tokens": 6, "eos_id": None, "pad_id": tokenizer.pad_token_id}
    clean = generate_with_images(model, batch, **options)
    hub = GenerationConfig(repetition_penalty=50.0, suppress_tokens=[int(clean[0, 0])], no_repeat_ngram_size=1)
    model.generation_config = hub
    assert torch.equal(generate_with_images(model, batch, **options), clean) and model.generation_config is hub
    naive = model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"],
                           pixel_values=batch["prompt_pixel_values"], image_grid_thw=batch["prompt_image_grid_thw"],
                           mm_token_type_ids=batch["prompt_mm_token_type_ids"], generation_config=GenerationConfig(
                               max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id))
    assert int(naive[0, batch["prompt_ids"].size(1)]) != int(clean[0, 0])  # what the folder's config would do
