"""Vision-language SFT (``vision_causal_lm`` rows, ``data.format: vision_chat``): causal LM training on the
assistant's text, with the conversation's images passed to the model.

Everything the loop sees is the causal LM task's: the token-weighted next-token loss over answer tokens (image and
prompt tokens are IGNORE), ``token_accuracy`` and ``exact_match``. What differs is the batch: the collator adds the
images' pixel values, patch grids and the image-token mask (:class:`finetune.data.vision.VisionCollator`), and the
forward gets the row's ``model_inputs``, which name them. Generation for ``exact_match`` runs the model's own
``generate`` with the prompt's images: a multimodal model places its rotary positions from the images (Qwen2-VL's
3-D positions), which a plain decoding loop does not know. It decodes greedily for ``eval.max_new_tokens`` tokens;
on a sharded backend every rank keeps stepping until all have finished (``synced_gpus``), so the ranks stay in
lockstep as the text task's fixed-length loop keeps them.
"""

from __future__ import annotations

from typing import Any

import torch

from finetune.data.vision import ImageInputs, VisionCollator
from finetune.tasks.causal_lm import CausalLMTask

PROMPT_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")  # the collator's prompt_<key> tensors


class VisionCausalLMTask(CausalLMTask):
    """The causal LM task over vision_chat rows; ``images`` is the model's image processor."""

    def __init__(self, *args: Any, images: ImageInputs, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.images = images

    def train_collator(self) -> VisionCollator:
        return VisionCollator(self.pad_id, self.images)

    def eval_collator(self) -> VisionCollator:
        return VisionCollator(self.pad_id, self.images, with_prompts=self.with_prompts)

    def _generate(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        return generate_with_images(model, batch, max_new_tokens=self.cfg.eval.max_new_tokens,
                                    eos_id=self.stop_ids, pad_id=self.pad_id, synced_gpus=self.lockstep)


def generate_with_images(model: Any, batch: dict[str, Any], *, max_new_tokens: int, eos_id: list[int], pad_id: int,
                         synced_gpus: bool = False, temperature: float = 0.0, top_p: float = 1.0) -> torch.Tensor:
    """The new tokens the model's own ``generate`` writes after the batch's left-padded ``prompt_ids`` with their
    images (the ``prompt_`` keys of :class:`VisionCollator`): greedy at ``temperature`` 0, else sampled from
    softmax(logits / temperature) within the ``top_p`` nucleus (no top-k cut), from torch's global generator.
    Rows that end (at a token of ``eos_id``: the stop tokens) are padded while the others go on; it stops when all
    have ended.

    Only these settings decide the tokens: transformers fills every setting a GenerationConfig leaves unset from
    the model folder's own ``generation_config.json`` (a hub chat model's ``repetition_penalty``, ``top_k``,
    sampling defaults), so that file is set aside for the call and restored after it."""
    from accelerate.utils import extract_model_from_parallel  # lazy: heavy
    from transformers import GenerationConfig  # lazy: heavy

    prompt = batch["prompt_ids"]
    sample = temperature > 0
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=eos_id or None,
                              pad_token_id=pad_id, **({"temperature": temperature, "top_p": top_p, "top_k": 0}
                                                      if sample else {}))
    images = {key: batch[f"prompt_{key}"] for key in PROMPT_KEYS if f"prompt_{key}" in batch}
    inner = extract_model_from_parallel(model)
    own, inner.generation_config = inner.generation_config, GenerationConfig()
    try:
        out = inner.generate(input_ids=prompt, attention_mask=batch["prompt_mask"], **images,
                             generation_config=config, synced_gpus=synced_gpus)
    finally:
        inner.generation_config = own
    return out[:, prompt.size(1):]
