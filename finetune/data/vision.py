"""Images in chat messages (``data.format: vision_chat``): checked, opened, expanded to image tokens, collated.

A row is ``{messages: [...]}`` as for ``chat``, except that a user (or system) turn's content may be a list of
parts: ``{type: text, text: ...}`` and ``{type: image, image: "path"}``, the path relative to the data file. The
conversation is rendered with the chat template like any chat row (so the answer spans are found the same way); the
template writes one placeholder token per image, and each placeholder is then repeated once per image feature the
model will put there (for Qwen2-VL: the image processor's patch grid, ``t x h x w``, over the merged ``2 x 2``
patches). Tokenization opens every image once to learn its grid, and records the absolute paths and grids; the
collator opens the images again, turns them into pixel values with the model's image processor and checks that each
grid is still the recorded one (an image edited after tokenization would otherwise no longer fit its tokens).

Image tokens are never trained on (their label is IGNORE even with ``data.train_on_prompt``), and an over-long
sample is never cut inside an image: the cut moves back to the start of that image's tokens and the images after it
are left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.data.formats import Rendered
from finetune.data.rows import IGNORE, ROLES, short_repr
from finetune.errors import DataError

if TYPE_CHECKING:
    import torch

def check_row(row: dict[str, Any], where: str, *, prompt: bool = False) -> None:
    """A vision_chat row: ``messages``, ``{role, content}`` turns ending with the assistant's (or, for a ``prompt``
    to generate from, not ending with it); content is a string or a list of text/image parts, and only user and
    system turns may hold images (the model learns and writes text).

    An image part names its path (``{type: image, image: path}``), or, as TRL's vision data sets do, is a bare
    ``{type: image}`` whose path is the next one of the row's ``images`` list; a row uses one form or the other."""
    value, images = row.get("messages"), row.get("images")
    if images is not None and (not isinstance(images, list) or not all(
            isinstance(path, str) and path.strip() for path in images)):
        raise DataError(f"{where}: field 'images' must be a list of image paths, got {short_repr(images)}")
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
    named, bare = 0, 0
    for i, msg in enumerate(value):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise DataError(f"{where}: messages[{i}] needs role in {ROLES}, got {role!r}")
        content = msg.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise DataError(f"{where}: messages[{i}].content must be a string or a non-empty list of parts "
                            f"{{type: text, text}} / {{type: image, image}}, got {short_repr(content)}")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            has_path = kind == "image" and isinstance(part.get("image"), str) and part["image"].strip()
            if has_path or (kind == "image" and part.get("image") is None and images is not None):
                if role == "assistant":
                    raise DataError(f"{where}: messages[{i}].content[{j}] is an image in an assistant turn; images "
                                    "belong in user turns (the model learns the assistant's text)")
                named, bare = named + bool(has_path), bare + (not has_path)
                continue
            raise DataError(f"{where}: messages[{i}].content[{j}] must be {{type: text, text: string}} or "
                            f"{{type: image, image: path}} (or a bare {{type: image}} with the row's 'images' list), "
                            f"got {short_repr(part)}")
    if images is not None and (named or bare != len(images)):
        raise DataError(f"{where}: the row's 'images' list has {len(images)} path(s) for {bare} bare {{type: image}} "
                        f"part(s){f' and {named} part(s) naming their own path' if named else ''}; give one path "
                        "per bare image part, or name each path in its part and drop 'images'")
    if prompt and value[-1]["role"] == "assistant":
        raise DataError(f"{where}: the last message is the assistant's; drop it (generate writes the assistant's "
                        "turn)")
    if not prompt and value[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's (it is what the model learns)")


def image_refs(row: dict[str, Any]) -> list[str]:
    """The image paths of a (checked) row, in order, as written: in each image part, or in its ``images`` list."""
    listed = iter(row.get("images") or ())
    return [part["image"] if part.get("image") is not None else next(listed) for msg in row["messages"]
            if isinstance(msg["content"], list) for part in msg["content"] if part.get("type") == "image"]


def text_of(content: Any) -> str:
    """A turn's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if part.get("type") == "text")


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: text-only turns as strings, image parts as ``{type: image}``
    (what Qwen-style templates test for), text parts as ``{type: text, text}``."""
    out = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, list) and any(part.get("type") == "image" for part in content):
            content = [{"type": "image"} if part.get("type") == "image" else {"type": "text", "text": part["text"]}
                       for part in content]
        else:
            content = text_of(content)
        out.append({"role": msg["role"], "content": content})
    return out


def resolve(ref: str, source: str) -> Path:
    """An image path as written in a row of ``source``: absolute, or relative to the data file's folder."""
    path = Path(ref).expanduser()
    if path.is_absolute():
        return path
    base = Path(source)
    return (base.parent if base.is_file() else Path.cwd()) / path


def open_image(path: Path, where: str) -> Any:
    """The image at ``path`` as RGB, fully read; one DataError line (naming ``where``) when it cannot be."""
    from PIL import Image, UnidentifiedImageError  # lazy: heavy

    if not path.is_file():
        raise DataError(f"{where}: image not found: {path} (a relative image path starts at the folder of the file "
                        "that names it)")
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{where}: cannot read image {path} ({type(exc).__name__}: {str(exc)[:120]}); use a "
                        "PNG/JPEG/WebP file") from None


def check_placeholders(text: str, token: str, images: int, where: str) -> None:
    """The chat template wrote one ``token`` per image of the conversation (else the tokens cannot be placed)."""
    written = text.count(token)
    if written != images:
        raise DataError(f"{where}: the chat template wrote {written} image placeholder(s) {token!r} for {images} "
                        "image(s); use the model's own chat template (it must render image parts)")


def expand(rendered: Rendered, token: str, counts: Sequence[int]) -> Rendered:
    """Repeat the i-th ``token`` placeholder of the text (and of the generation prompt, which renders the same
    images first) ``counts[i]`` times, moving the answer spans with the text."""

    text, moves = _grow(rendered.text, token, counts)

    def shift(position: int) -> int:
        return position + sum(added for at, added in moves if at < position)

    spans = tuple((shift(a), shift(b)) for a, b in rendered.spans)
    prompt = _grow(rendered.prompt, token, counts)[0] if rendered.prompt else rendered.prompt
    return dataclasses.replace(rendered, text=text, spans=spans, prompt=prompt)


def expand_text(text: str, token: str, counts: Sequence[int]) -> str:
    """``text`` with its i-th ``token`` placeholder repeated ``counts[i]`` times (a prompt without answer spans)."""
    return _grow(text, token, counts)[0]


def _grow(text: str, token: str, counts: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """The expanded text, and where characters were added: (position in the old text, how many)."""
    pieces, moves, start = [], [], 0
    for count in counts:
        at = text.find(token, start)
        if at < 0:
            break
        pieces += [text[start:at], token * count]
        moves.append((at, len(token) * (count - 1)))
        start = at + len(token)
    pieces.append(text[start:])
    return "".join(pieces), moves


def fit(ids: list[int], image_id: int, counts: Sequence[int], max_len: int) -> tuple[int, int]:
    """Where to cut ``ids`` to at most ``max_len`` tokens without splitting an image, and how many images stay."""
    if len(ids) <= max_len:
        return len(ids), len(counts)
    cut = max_len
    while 0 < cut < len(ids) and ids[cut - 1] == image_id and ids[cut] == image_id:
        cut -= 1  # inside an image's run of tokens: cut before the whole run
    kept = sum(1 for _ in _runs(ids[:cut], image_id))
    return cut, kept


def _runs(ids: list[int], image_id: int) -> list[int]:
    """Lengths of the runs of ``image_id`` in ``ids`` (one per image when images are not adjacent)."""
    runs, length = [], 0
    for tid in ids:
        if tid == image_id:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    if length:
        runs.append(length)
    return runs


@dataclass
class ImageInputs:
    """The model's image processor and what an image costs in tokens.

    ``tokens(grid)`` is the number of placeholder tokens an image with patch grid ``grid`` (``t, h, w``) takes:
    the grid's product over the merged patch area (``merge_size ** 2``), as Qwen2-VL / Qwen2.5-VL place them."""

    processor: Any
    image_token: str
    image_token_id: int

    def tokens(self, grid: Sequence[int]) -> int:
        merge = int(getattr(self.processor, "merge_size", 1) or 1)
        return math.prod(grid) // (merge * merge)

    def grids(self, images: list[Any], where: str = "data", paths: Sequence[Any] = ()) -> list[list[int]]:
        """Each image's patch grid (what the processor will make of it). An image the processor refuses (a 1x300
        strip: Qwen2-VL's 'absolute aspect ratio must be smaller than 200', or a side below its patch size) is one
        DataError line naming ``where``, the image (from ``paths``), its size and the processor's reason."""
        if not images:
            return []
        try:
            return self.processor(images=images, return_tensors="pt")["image_grid_thw"].tolist()
        except ValueError as exc:
            reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            named = list(paths) or [f"image {i + 1}" for i in range(len(images))]
            sizes = ", ".join(f"{name} is {img.width}x{img.height}" for name, img in zip(named, images, strict=False))
            raise DataError(f"{where}: the model's image processor refuses an image ({sizes}): {reason}; use images "
                            "with sides of at least a few dozen pixels and a moderate aspect ratio") from None

    def pixels(self, images: list[Any]) -> dict[str, torch.Tensor]:
        """The processor's tensors for ``images`` (pixel_values, image_grid_thw)."""
        return dict(self.processor(images=images, return_tensors="pt"))


def load_images(paths: Sequence[str], grids: Sequence[Sequence[int]], inputs: ImageInputs) -> dict[str, torch.Tensor]:
    """Pixel values for the images at ``paths``, each checked to still have its recorded patch ``grids``."""
    images = [open_image(Path(path), "data") for path in paths]
    out = inputs.pixels(images)
    now = out["image_grid_thw"].tolist()
    for path, before, after in zip(paths, grids, now, strict=True):
        if list(before) != list(after):
            raise DataError(f"data: image {path} changed after the data was tokenized (patch grid {list(before)} "
                            f"then, {after} now); restore it, or edit the data file so it is tokenized again")
    return out


class VisionCollator:
    """Padded text (:class:`finetune.data.batching.Collator`) plus the batch's images: ``pixel_values`` and
    ``image_grid_thw`` of the images the (possibly cut) inputs hold, and ``mm_token_type_ids`` (1 on image tokens,
    0 elsewhere), from which Qwen2-VL computes its multimodal rotary positions. With prompts (generation), the same
    for the prompts under ``prompt_`` names.

    A batch (or a prompt set) without a single image still runs the vision tower: it gets one blank placeholder
    image, whose tokens sit in extra columns that are masked out (attention mask 0, label IGNORE; appended after
    right-padded inputs, prepended before left-padded prompts, in row 0, every other row padded). No real token can
    attend to them, so the loss, the metrics and the generated text are those of the batch without it, and the
    vision weights get an exactly-zero gradient. Without it, a rank whose micro-batch is text-only (mixed data, or
    truncation that left every image out) would skip the vision tower while another runs it: DDP's gradient
    all-reduce, FSDP's and ZeRO-3's parameter gathers would then no longer match across ranks (gloo aborts; NCCL
    hangs). The collator adds it on one process too, so every process count sees the same batches."""

    def __init__(self, pad_id: int, inputs: ImageInputs, *, with_prompts: bool = False) -> None:
        from finetune.data.batching import Collator  # imports torch

        self.text = Collator(pad_id, with_prompts=with_prompts)
        self.pad_id, self.inputs, self.with_prompts = pad_id, inputs, with_prompts
        self._blank: dict[str, torch.Tensor] | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.text(rows)
        kept = _kept_images(rows)
        needed = [i for i in range(sum(len(row["images"]) for row in rows)) if self.with_prompts or i in kept]
        pixels, spans = self._load(rows, needed)  # training reads only the images its inputs hold
        self._add(batch, "", pixels, [spans[i] for i in needed if i in kept])
        if self.with_prompts:
            self._add(batch, "prompt_", pixels, [spans[i] for i in needed])
        return batch

    def prompts(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The generation side alone (``finetune generate``): rows of ``prompt_ids``, ``images`` and
        ``image_grids`` as ``prompt_ids``/``prompt_mask`` (left-padded) and the ``prompt_`` image keys."""
        from finetune.data.batching import left_pad  # imports torch

        batch = dict(zip(("prompt_ids", "prompt_mask"), left_pad([r["prompt_ids"] for r in rows], self.pad_id),
                         strict=True))
        every = list(range(sum(len(row["images"]) for row in rows)))
        pixels, spans = self._load(rows, every)
        self._add(batch, "prompt_", pixels, [spans[i] for i in every])
        return batch

    def _load(self, rows: list[dict[str, Any]], needed: list[int]) -> tuple[dict[str, torch.Tensor], dict]:
        """Pixel values of the batch-wide images ``needed``, and each one's rows of them (its patches) and place."""
        images = [(path, grid) for row in rows for path, grid in zip(row["images"], row["image_grids"], strict=True)]
        pixels = (load_images([images[i][0] for i in needed], [images[i][1] for i in needed], self.inputs)
                  if needed else {})
        spans, offset = {}, 0
        for place, i in enumerate(needed):
            patches = math.prod(images[i][1])
            spans[i] = (offset, offset + patches, place)
            offset += patches
        return pixels, spans

    def _add(self, batch: dict[str, Any], prefix: str, pixels: dict[str, torch.Tensor],
             chosen: list[tuple[int, int, int]]) -> None:
        import torch  # lazy: heavy

        if chosen:
            batch[f"{prefix}pixel_values"] = torch.cat([pixels["pixel_values"][a:b] for a, b, _ in chosen])
            batch[f"{prefix}image_grid_thw"] = pixels["image_grid_thw"][[image for _, _, image in chosen]]
        else:
            self._add_blank(batch, prefix)
        ids = batch["prompt_ids" if prefix else "input_ids"]
        batch[f"{prefix}mm_token_type_ids"] = (ids == self.inputs.image_token_id).int()

    def _add_blank(self, batch: dict[str, Any], prefix: str) -> None:
        """The placeholder image (see the class docstring) in masked extra columns of row 0."""
        import torch  # lazy: heavy
        from PIL import Image  # lazy: heavy

        if self._blank is None:  # the processor's own output for a small black image, made once
            self._blank = self.inputs.pixels([Image.new("RGB", (28, 28))])
        batch[f"{prefix}pixel_values"] = self._blank["pixel_values"]
        batch[f"{prefix}image_grid_thw"] = self._blank["image_grid_thw"]
        n = self.inputs.tokens(self._blank["image_grid_thw"][0].tolist())
        keys = {"prompt_ids": self.pad_id, "prompt_mask": 0} if prefix else {
            "input_ids": self.pad_id, "attention_mask": 0, "labels": IGNORE}
        for key, fill in keys.items():
            if key not in batch:
                continue
            extra = torch.full((batch[key].size(0), n), fill, dtype=batch[key].dtype)
            if key.endswith("ids"):
                extra[0] = self.inputs.image_token_id
            batch[key] = torch.cat([extra, batch[key]] if prefix else [batch[key], extra], dim=1)


def _kept_images(rows: list[dict[str, Any]]) -> set[int]:
    """Batch-wide indices of the images each row's (possibly cut) inputs still hold: its first ``n_images``."""
    kept, index = set(), 0
    for row in rows:
        kept.update(range(index, index + row["n_images"]))
        index += len(row["images"])
    return kept
