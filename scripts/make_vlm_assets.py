"""Write the bundled tiny vision-language tokenizer and image processor, ``finetune/assets/tiny-qwen2-vl``.

The tokenizer is the bundled tiny-llama BPE tokenizer plus Qwen2-VL's special tokens (chat turns ``<|im_start|>``
/ ``<|im_end|>``, and ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` around each image), with a chat
template in Qwen2-VL's form that writes one ``<|image_pad|>`` per image part. The image processor is transformers'
Qwen2-VL one (its PIL backend: no torchvision needed), sized so a 56x56 image is 4x4 patches of 14 pixels, merged
2x2 into 4 image tokens. The token ids this produces are the ``_VLM_TOKENS`` of ``finetune/registry.py``.
Deterministic: re-running rewrites the same files::

    .venv/bin/python scripts/make_vlm_assets.py
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "finetune" / "assets"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- else %}{{- raise_exception('Unknown content part type: ' + part['type']) }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def main() -> None:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = ASSETS / "tiny-qwen2-vl"
    tokenizer = AutoTokenizer.from_pretrained(str(ASSETS / "tiny-llama-tokenizer"))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.bos_token = None  # Qwen2-VL starts with the first turn, no bos
    tokenizer.eos_token = "<|im_end|>"  # generation stops at the end of the assistant turn
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}).save_pretrained(str(out))
    ids = tokenizer.convert_tokens_to_ids(SPECIAL)
    print(f"wrote {out}: {len(tokenizer)} tokens; special ids {dict(zip(SPECIAL, ids, strict=True))}")


if __name__ == "__main__":
    main()
