"""Generate the vision-language quickstart data, ``recipes/data/shapes/``: small images of one coloured shape on
a 2 x 2 grid, with questions whose answers need the image.

Each image is 56 x 56 pixels (4 tokens for the tiny Qwen2-VL: one per 28 x 28 cell), white, with one shape (circle,
square or triangle, size and place jittered inside its cell) of one of four colours in one of the four cells. Each
row asks one question about its own image: "What colour is the shape?" (red, green, blue, yellow) or "Where is the
shape?" (top left, top right, bottom left, bottom right). The answer is the same for any text, so a model that does
not look at the image is at the majority baseline. Deterministic (fixed seed)::

    .venv/bin/python scripts/make_shapes.py

Writes ``images/{train,eval}-NNNN.png``, ``train.jsonl`` (1200 rows) and ``eval.jsonl`` (96 rows, images never seen
in training).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "recipes" / "data" / "shapes"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (235, 200, 20)}
CELLS = {"top left": (0, 0), "top right": (1, 0), "bottom left": (0, 1), "bottom right": (1, 1)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "place": "Where is the shape?"}
SIZE, CELL = 56, 28


def draw(colour: str, cell: str, shape: str, rng: random.Random) -> object:
    """One image: white, with ``shape`` in ``colour`` inside ``cell`` (jittered size and position)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    half = rng.randint(11, 13)
    cx = CELLS[cell][0] * CELL + CELL // 2 + rng.randint(-1, 1)
    cy = CELLS[cell][1] * CELL + CELL // 2 + rng.randint(-1, 1)
    box = (cx - half, cy - half, cx + half, cy + half)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=fill)
    return image


def write(split: str, rows: int, rng: random.Random) -> None:
    """``rows`` rows of ``split``: one new image each, questions alternating colour / place."""
    lines = []
    for i in range(rows):
        colour, cell, shape = rng.choice(list(COLOURS)), rng.choice(list(CELLS)), rng.choice(SHAPES)
        name = f"images/{split}-{i:04d}.png"
        draw(colour, cell, shape, rng).save(OUT / name, optimize=True)
        kind = "colour" if i % 2 == 0 else "place"
        answer = colour if kind == "colour" else cell
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": QUESTIONS[kind]}]},
            {"role": "assistant", "content": answer}]}))
    (OUT / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def main() -> None:
    (OUT / "images").mkdir(parents=True, exist_ok=True)
    for old in (OUT / "images").glob("*.png"):
        old.unlink()  # our own generated files only (this script's folder)
    rng = random.Random(13)
    write("train", 1200, rng)
    write("eval", 96, rng)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
