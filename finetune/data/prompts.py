"""A generation prompt's token ids, made one way for training and for ``finetune generate``.

Training stores each row's prompt as the ``prompt_ids`` column (what eval's exact_match generates from, see
:mod:`finetune.data.tokenize`); ``finetune generate`` tokenizes the lines of a prompts file. Both go through the
functions here, one per prompt kind, so a fine-tuned model gets the prompt it learned from:

- text (a raw prompt, or the prompt side of an alpaca / completion / string preference row): the text as it is;
- chat: the messages before the final assistant turn through the tokenizer's chat template with its generation
  prompt (:func:`chat_text`, which training's chat rendering also uses);
- vision (``vision_chat``): the same for messages whose turns hold image parts (:func:`vision_text`), then each
  image placeholder repeated once per image feature (:func:`vision_prompt`).

Two rules hold for every kind. Special tokens: the tokenizer adds none; what goes before the text's tokens is
``data.add_bos``'s rule (:class:`finetune.data.bos.Lead`, the rule of whole training samples too): under ``auto`` a
chat template's render gets nothing (exactly ``apply_chat_template(..., tokenize=True)``), a raw text what the
tokenizer's own call puts first.

Length: a prompt over ``max_len`` tokens keeps its last ``max_len`` (the cue to answer is at the
end); a vision prompt whose kept end would leave out image tokens is kept whole instead and marked
:attr:`PromptIds.cuts_image` (training generates from it whole; generate refuses it in one line), since its
images cannot be given to the model in part. """

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from finetune.data import vision
from finetune.data.formats import generation_prompt

if TYPE_CHECKING:
    from finetune.data.bos import Lead
    from finetune.data.vision import ImageInputs


@dataclass(frozen=True)
class PromptIds:
    """A prompt as the model gets it: ``ids`` (the end kept), ``length`` (its tokens before that), its images'
    patch ``grids`` (vision), and ``cuts_image``: keeping the end would have left out an image, so it is whole."""

    ids: list[int]
    length: int
    grids: list[list[int]] = field(default_factory=list)
    cuts_image: bool = False

    @property
    def truncated(self) -> bool:
        """Whether the prompt lost its start to ``max_len``."""
        return len(self.ids) < self.length


def encode(text: str, tokenizer: Any, lead: Lead, templated: bool) -> list[int]:
    """Token ids of a prompt's text: no special tokens added by the tokenizer, ``lead``'s before them
    (``templated``: the text is a chat template's render)."""
    return lead.encode(text, list(tokenizer(text, add_special_tokens=False)["input_ids"]), templated)


def keep_end(ids: list[int], max_len: int, image_id: int | None = None, grids: Sequence[Sequence[int]] = ()
             ) -> PromptIds:
    """``ids`` cut to their last ``max_len``; whole, and marked, when the part cut off holds an ``image_id``."""
    if len(ids) <= max_len:
        return PromptIds(ids, len(ids), [list(g) for g in grids])
    head = ids[:len(ids) - max_len]
    if image_id is not None and image_id in head:
        return PromptIds(ids, len(ids), [list(g) for g in grids], cuts_image=True)
    return PromptIds(ids[-max_len:], len(ids), [list(g) for g in grids])


def text_prompt(text: str, tokenizer: Any, max_len: int, lead: Lead, templated: bool) -> PromptIds:
    """The text kind (and the chat kind, from :func:`chat_text`, ``templated``): encoded, its end kept."""
    return keep_end(encode(text, tokenizer, lead, templated), max_len)


def chat_text(messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> str:
    """The chat kind's prompt text: ``messages`` (no final assistant turn) through the chat template (``tools``
    given to it), with its generation prompt."""
    return generation_prompt(messages, tokenizer, tools)


def vision_text(messages: list[dict[str, Any]], tokenizer: Any) -> str:
    """The vision kind's prompt text: as :func:`chat_text`, with image parts as the template's placeholders (one
    per image)."""
    return generation_prompt(vision.for_template(messages), tokenizer)


def vision_prompt(text: str, tokenizer: Any, images: ImageInputs, grids: Sequence[Sequence[int]], where: str,
                  max_len: int, lead: Lead, templated: bool) -> PromptIds:
    """The vision kind: ``text`` (from :func:`vision_text`, ``templated``, or a raw prompt for a vision model) with
    its i-th placeholder repeated once per feature of the image of patch grid ``grids[i]``, encoded, its end kept unless
    that would cut an image. One DataError line (naming ``where``) when the text does not hold one placeholder
    per image."""
    vision.check_placeholders(text, images.image_token, len(grids), where)
    if grids:
        text = vision.expand_text(text, images.image_token, [images.tokens(grid) for grid in grids])
    return keep_end(encode(text, tokenizer, lead, templated), max_len, images.image_token_id, grids)
