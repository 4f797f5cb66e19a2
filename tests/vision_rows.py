"""vision_chat rows for the unit tests of the vision modules (tests/unit/test_vision.py, test_vision_lm.py): the
tiny Qwen2-VL row, images written on the fly, the parts of a message, and the rows tokenized as training does. The
row's tokenizer and image inputs are the ``tools`` fixture of tests/unit/conftest.py."""

from __future__ import annotations

import json
from pathlib import Path

from finetune import registry
from finetune.data.loading import load_raw
from finetune.data.tokenize import tokenize_rows

ROW = registry.get_model("tiny-qwen2-vl")


def image(path: Path, colour: str = "red", size: tuple[int, int] = (56, 56)) -> str:
    """Write a one-colour image to ``path``; its name, as a row refers to it beside the data file."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path.name


def turn(*parts: dict) -> dict:
    """A user turn of the given content parts."""
    return {"role": "user", "content": list(parts)}


def img(name: str) -> dict:
    """An image part."""
    return {"type": "image", "image": name}


def text(value: str) -> dict:
    """A text part."""
    return {"type": "text", "text": value}


def write(tmp_path: Path, rows: list[dict]) -> str:
    """``rows`` as ``tmp_path/data.jsonl``; its path."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenize(tools: tuple, source: str, **kwargs):
    """The rows of ``source`` tokenized as training tokenizes vision_chat (``kwargs`` override the options)."""
    tokenizer, images = tools
    options = {"max_len": 64, "overlong": "truncate", "add_bos": "auto", **kwargs}
    return tokenize_rows(load_raw(source), fmt="vision_chat", tokenizer=tokenizer, source=source, images=images,
                         **options)


def qa(name: str, answer: str = "red") -> dict:
    """A row asking the colour of image ``name``, answered ``answer``."""
    return {"messages": [turn(img(name), text("What colour?")), {"role": "assistant", "content": answer}]}
