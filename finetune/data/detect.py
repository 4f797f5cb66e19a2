"""``data.format`` left out: each source's format read from its columns, by one rule written here.

The rule, in order of the columns a source has (after its ``columns`` mapping, :mod:`finetune.data.mapping`); the
shapes are TRL's dataset shapes and the common instruction formats:

==========================================  ======================================  ==============
columns                                     shape                                   format
==========================================  ======================================  ==============
``chosen``, ``rejected``                    preference pairs (conversational when   preference
                                            they are message lists)
``prompt``, ``completion``, ``label``       unpaired preference (KTO)               refused
``prompt``, ``completion`` (message lists)  conversational prompt-completion        chat
``prompt``, ``completion`` (text)           prompt-completion                       completion
``messages``                                conversational                          chat, or
                                                                                    vision_chat /
                                                                                    prompt where
                                                                                    the task takes
                                                                                    only that
``conversations``                           ShareGPT conversations                  chat
``instruction``, ``output``                 alpaca                                  alpaca
``text``, ``label``                         classification                          classification
``text``                                    language modeling                       completion
``prompt``                                  prompt-only                             prompt
==========================================  ======================================  ==============

A shape whose columns are all among the columns another matching shape reads is left out for it (``text`` and
``label`` is classification, not language modeling). Of the rest, the shapes whose format the recipe's task
trains are kept: exactly one is the source's format; none, or two, is one line listing the columns found and the
shapes the task reads (set ``data.format``, or map the columns). An explicit format (``data.format`` or a
source's ``format``) is never second-guessed. What was found is said once per source (:func:`describe`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.errors import DataError

UNPAIRED = ("an unpaired preference (KTO's shape: prompt, completion, label), which no finetune task trains on; pair "
            "the answers as {prompt, chosen, rejected} for task dpo or reward, or drop 'label' for task sft")


@dataclass(frozen=True)
class Found:
    """One shape of the rule: its ``name``, the ``columns`` it needs, the ``format`` it is read as (for the
    formats a task takes, ``choose``), whether its message lists decide it (``lists``: True when the columns must
    hold message lists, False when text, None either), and the ``optional`` columns it also reads."""

    name: str
    columns: tuple[str, ...]
    choose: Callable[[frozenset[str]], str | None]
    lists: bool | None = None
    optional: tuple[str, ...] = ()  # columns it reads when there (a pair's string prompt), not needed


def _one(fmt: str) -> Callable[[frozenset[str]], str | None]:
    return lambda allowed: fmt


def _messages(allowed: frozenset[str]) -> str | None:
    """``messages`` rows: chat, unless the task takes only vision chats or only prompts."""
    for fmt in ("chat", "vision_chat", "prompt"):
        if fmt in allowed:
            return fmt
    return "chat"


RULE: tuple[Found, ...] = (
    Found("preference pairs", ("chosen", "rejected"), _one("preference"), optional=("prompt",)),
    Found("unpaired preference", ("prompt", "completion", "label"), _one("unpaired")),
    Found("conversational prompt-completion", ("prompt", "completion"), _one("chat"), lists=True),
    Found("prompt-completion", ("prompt", "completion"), _one("completion"), lists=False),
    Found("conversational", ("messages",), _messages),
    Found("ShareGPT conversations", ("conversations",), _one("chat")),
    Found("alpaca", ("instruction", "output"), _one("alpaca")),
    Found("classification", ("text", "label"), _one("classification")),
    Found("language modeling", ("text",), _one("completion")),
    Found("prompt-only", ("prompt",), _one("prompt")),
)


def holds_lists(feature: Any) -> bool | None:
    """Whether a ``datasets`` feature holds lists (message lists), text (False), or cannot say (None)."""
    kind = type(feature).__name__
    if kind in ("List", "Sequence", "LargeList"):
        return True
    if kind == "Value":
        return False
    return None


def detect(names: list[str], features: Any, allowed: frozenset[str], source: str) -> tuple[str, str]:
    """The format of a source with columns ``names`` (``features``: their ``datasets`` types) for a task that
    trains ``allowed`` formats, and the shape's name; one DataError line when none fits, two do, or the rows are
    an unpaired preference."""
    have = set(names)
    matched = [found for found in RULE if set(found.columns) <= have
               and (found.lists is None or holds_lists(features.get(found.columns[-1])) in (found.lists, None))]
    reads = {found.name: set(found.columns) | (set(found.optional) & have) for found in matched}
    matched = [found for found in matched
               if not any(reads[found.name] < reads[other.name] for other in matched)]
    if any(found.name == "unpaired preference" for found in matched):
        raise DataError(f"{source}: the rows are {UNPAIRED}")
    fits = [(found, found.choose(allowed)) for found in matched]
    fits = [(found, fmt) for found, fmt in fits if fmt in allowed]
    found_columns = ", ".join(names) or "none"
    if len(fits) == 1:
        found, fmt = fits[0]
        return fmt, found.name
    readable = "; ".join(f"{found.name} ({', '.join(found.columns)})" for found in RULE
                         if found.choose(allowed) in allowed)
    if not fits:
        other = f" (its columns fit {', '.join(f.name for f in matched)}, which this task does not train)" \
            if matched else ""
        raise DataError(f"{source}: its columns ({found_columns}) fit no row shape this task reads{other}; the task "
                        f"reads {readable}: rename them with the source's columns mapping, or set data.format")
    raise DataError(f"{source}: its columns ({found_columns}) fit more than one row shape ("
                    f"{', '.join(found.name for found, _ in fits)}); set data.format (or the source's format) to "
                    "say which")


def describe(key: str, source: str, shape: str, rows: int) -> str:
    """The line that says what was found in a source whose format was left out."""
    return f"{key} {source}: {shape}, {rows:,} rows (data.format left out: read from its columns)"
