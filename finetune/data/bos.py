"""The one rule for the special tokens that go before a text's own tokens (``data.add_bos``).

Every text finetune tokenizes is tokenized with ``add_special_tokens=False``; what goes before its tokens is decided
here, for training samples, eval prompts, ``finetune generate`` prompts, GRPO prompts and reward-model texts alike.

``auto`` (the default): a text is tokenized as the ecosystem tokenizes it when the model is served.

- A chat template's render (chat samples and prompts, chat preference pairs, vision chats): nothing is added. The
  template writes every special token it wants (Llama 3 and Gemma write their bos, Qwen and the tiny bundled
  template none), and ``apply_chat_template(..., tokenize=True)``, vLLM and every Hugging Face consumer tokenize the
  rendered text without adding special tokens: a sample is exactly that call's tokens.
- Raw text (alpaca, completion, string preference pairs, a text prompt): the special tokens the tokenizer's own call
  ``tokenizer(text)`` puts before the text (Llama's bos; nothing for Qwen or GPT-2), read once per tokenizer from a
  probe (:func:`own_lead`). A text that already starts with the bos token does not get a second one.

``always`` (what finetune did before ``data.add_bos`` existed; a run trained then is resumed, evaluated and served
with it, see :data:`finetune.config.schema.STORED_DEFAULTS`): the tokenizer's bos token goes first unless the
tokenizer has none or the text already starts with it, whatever kind the text is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RULES = ("auto", "always")  # data.add_bos's values
PROBE = "Hello"  # a plain word every tokenizer has tokens for: what its own call adds around it is read off


def own_lead(tokenizer: Any) -> tuple[int, ...]:
    """The special tokens ``tokenizer(text)`` puts before a text's own tokens: its call with special tokens minus
    its call without, on :data:`PROBE` (the tokens after the text, such as an eos some tokenizers append, are not
    part of it). None found, or a tokenizer whose two calls do not differ by a prefix and suffix: nothing."""
    try:
        full = list(tokenizer(PROBE, add_special_tokens=True)["input_ids"])
        bare = list(tokenizer(PROBE, add_special_tokens=False)["input_ids"])
    except Exception:  # a tokenizer that cannot be called this way adds nothing finetune could know of
        return ()
    if not bare:
        return ()
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return tuple(full[:start])
    return ()


@dataclass(frozen=True)
class Lead:
    """What goes before a text's tokens under ``rule`` for one tokenizer, read from it once (each read of
    ``tokenizer.bos_token_id`` is a lookup through transformers' ``__getattr__``, about 10 us; a batch of rows
    reads this instead). ``eos_token_id`` rides along for the formats that append it."""

    rule: str
    bos_token_id: int | None
    bos_token: str | None
    eos_token_id: int | None
    own: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any, rule: str) -> Lead:
        """The rule ``rule`` (one of :data:`RULES`) for ``tokenizer``."""
        if rule not in RULES:
            raise ValueError(f"data.add_bos: {rule!r} is not one of {', '.join(RULES)}")
        return cls(rule, tokenizer.bos_token_id, tokenizer.bos_token, tokenizer.eos_token_id,
                   own_lead(tokenizer) if rule == "auto" else ())

    def starts_with_bos(self, text: str) -> bool:
        """Whether ``text`` begins with the bos token's text (a template or a user that wrote it)."""
        return bool(self.bos_token) and text.startswith(self.bos_token)  # type: ignore[arg-type]

    def ids(self, text: str, templated: bool) -> tuple[int, ...]:
        """The token ids put before ``text``'s own tokens; ``templated``: ``text`` is a chat template's render."""
        if self.rule == "always":
            return () if self.bos_token_id is None or self.starts_with_bos(text) else (self.bos_token_id,)
        if templated:
            return ()
        if self.own[:1] == (self.bos_token_id,) and self.starts_with_bos(text):
            return self.own[1:]
        return self.own

    def encode(self, text: str, ids: list[int], templated: bool) -> list[int]:
        """``ids`` (``text``'s tokens, no special tokens added) with :meth:`ids` put before them."""
        lead = self.ids(text, templated)
        return [*lead, *ids] if lead else list(ids)


__all__ = ["RULES", "Lead", "own_lead"]
