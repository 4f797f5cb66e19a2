"""Render raw rows of each causal-LM format into text plus the character spans the model learns.

Masking works on characters, not on separately tokenized pieces: the whole sample is tokenized once with
offsets, and a token is trained on when it starts inside an answer span. That keeps BPE merges at the
prompt/answer boundary identical to what the model sees at inference time.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from finetune.errors import DataError

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass(frozen=True)
class Rendered:
    """A rendered sample: ``text`` to tokenize, answer ``spans`` in it, and the prompt/reference for generation.

    ``add_eos`` says the tokenizer's eos token must be appended (and trained on) after ``text``; chat templates
    already end assistant turns with their own end marker. ``templated``: ``text`` (and ``prompt``) are a chat
    template's render, which wrote every special token it wants (:mod:`finetune.data.bos` adds none before them).
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    prompt: str
    reference: str
    add_eos: bool
    templated: bool = False


def render_alpaca(row: dict[str, Any]) -> Rendered:
    template = ALPACA_PROMPT_INPUT if (row.get("input") or "").strip() else ALPACA_PROMPT
    prompt = template.format(instruction=row["instruction"], input=row.get("input") or "")
    answer = row["output"]
    return Rendered(prompt + answer, ((len(prompt), len(prompt) + len(answer)),), prompt, answer, add_eos=True)


def render_completion(row: dict[str, Any]) -> Rendered:
    text = row["text"]
    return Rendered(text, ((0, len(text)),), "", text, add_eos=True)


# The fix every "no chat template" error names (the key is finetune.config.chat_templates.KEY)
TEMPLATE_FIX = "set model.chat_template (a named template: chatml, or the path of a .jinja file)"


def require_template(tokenizer: Any, what: str, otherwise: str) -> None:
    """One DataError line when ``tokenizer`` has no chat template: ``what`` needs one, the fix is
    ``model.chat_template`` (:data:`TEMPLATE_FIX`) or ``otherwise`` (the way to write the data without one)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{what}: rendered with the tokenizer's chat template, but this model's tokenizer has none; "
                        f"{TEMPLATE_FIX}, or {otherwise}")


def generation_prompt(messages: list[dict[str, Any]], tokenizer: Any) -> str:
    """``messages`` through the tokenizer's chat template with its generation prompt: the text a model continues
    with the assistant's turn (the prompt of a chat row, and what :mod:`finetune.data.prompts` renders)."""
    require_template(tokenizer, "a prompt written as messages", "write the prompt as text")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# A chat row's renders, each (prefix length, add_generation_prompt): ``messages[:n]`` through the chat template
ChatRender = tuple[int, bool]


def chat_renders(messages: list[dict[str, Any]]) -> list[ChatRender]:
    """The template renders :func:`render_chat` needs for ``messages``: the whole conversation, and for each
    assistant turn i the conversation before it with the generation prompt (i > 0) and up to it (unless it is the
    last message), plus the generation prompt of ``messages[:-1]`` when the last message is not an assistant's."""
    needed: list[ChatRender] = [(len(messages), False)]
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            needed += [(i, True)] if i else []
            needed += [(i + 1, False)] if i != len(messages) - 1 else []
    if not (len(messages) > 1 and messages[-1]["role"] == "assistant"):
        needed.append((len(messages) - 1, True))
    return needed


def prerender_chats(conversations: list[Any], tokenizer: Any) -> list[dict[ChatRender, str]] | None:
    """Every render :func:`render_chat` needs for each of ``conversations``: through the tokenizer's compiled
    template directly where that is provably what ``apply_chat_template`` renders (:class:`TemplateRenderer`),
    else in two batched ``apply_chat_template`` calls (one per ``add_generation_prompt``): the same template
    function on the same messages either way. None when any conversation is not a well-formed message list or the
    template raises for one: the caller then renders row by row, so a bad row is reported as it always was (which
    row, and after the checks of the rows before it)."""
    try:
        wanted = [chat_renders(messages) for messages in conversations]
        keys = {gen: [(row, n) for row, needed in enumerate(wanted) for n, g in needed if g == gen]
                for gen in (False, True)}
        direct = TemplateRenderer.of(tokenizer, conversations)
        out: list[dict[ChatRender, str]] = [{} for _ in conversations]
        for gen, rows in keys.items():
            if not rows:
                continue
            prefixes = [conversations[row][:n] for row, n in rows]
            texts = direct.render(prefixes, gen) if direct is not None else None
            if texts is None or [texts[0]] != tokenizer.apply_chat_template(prefixes[:1], tokenize=False,
                                                                            add_generation_prompt=gen):
                texts = tokenizer.apply_chat_template(prefixes, tokenize=False, add_generation_prompt=gen)
            if not isinstance(texts, list) or len(texts) != len(rows) or not all(isinstance(t, str) for t in texts):
                return None
            for (row, n), text in zip(rows, texts, strict=True):
                out[row][(n, gen)] = text
        return out
    except Exception:  # any failure: the row-by-row path finds the row and reports it (see the docstring)
        return None


# The message keys transformers aliases to one another before rendering (its _alias_reasoning_fields): a
# conversation holding one is rendered through apply_chat_template.
REASONING_KEYS = frozenset({"reasoning_content", "thinking", "reasoning"})


class TemplateRenderer:
    """The chat template's compiled jinja function called as ``apply_chat_template(conversations, tokenize=False,
    add_generation_prompt=gen)`` calls it, without its per-call set-up (argument handling, the special-tokens map,
    two deep copies of every message: a third of a render's time).

    transformers 5 renders each conversation as ``compiled.render(messages=chat, tools=None, documents=None,
    add_generation_prompt=gen, **special_tokens_map)``, where ``chat`` is a copy of the messages without the keys
    whose value is None, with reasoning keys aliased, every value rebuilt from plain JSON types. :meth:`of` takes
    this path only where that copy is exactly ``{key: value for ... if value is not None}``: the tokenizer does not
    override ``apply_chat_template``, its ``get_chat_template`` gives one template string, the call's defaults do
    not sanitize control tokens, and every message is a plain dict of str keys and str (or None) values with no
    reasoning key. Anything else (content lists, tool calls, a processor, a template dict without a default, an
    other transformers) is rendered by ``apply_chat_template`` itself. And :func:`prerender_chats` renders the
    first of each batched call both ways: a difference sends the call to ``apply_chat_template``.
    tests/unit/test_chat_prerender.py holds the two to identical strings on every shipped tokenizer.
    """

    def __init__(self, compiled: Any, variables: dict[str, Any]) -> None:
        self.compiled, self.variables = compiled, variables

    @classmethod
    def of(cls, tokenizer: Any, conversations: list[Any]) -> TemplateRenderer | None:
        """The direct renderer for ``conversations`` (see the class docstring), or None: use apply_chat_template."""
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # heavy: transformers
            from transformers.utils import chat_template_utils as chat_utils  # heavy: transformers

            method = getattr(type(tokenizer), "apply_chat_template", None)
            if method is not PreTrainedTokenizerBase.apply_chat_template:
                return None
            defaults = inspect.signature(method).parameters
            sanitize = defaults.get("sanitize_control_tokens")
            if sanitize is not None and sanitize.default is not False:
                return None
            template = tokenizer.get_chat_template(None, None)
            if not isinstance(template, str) or not all(map(_plain, conversations)):
                return None
            renderer = cls(chat_utils._compile_jinja_template(template),
                           chat_utils._plain_template_data(dict(tokenizer.special_tokens_map)))
        except Exception:  # an other transformers (names moved) or an unusual tokenizer: apply_chat_template
            return None
        return renderer

    def render(self, conversations: list[list[dict[str, Any]]], gen: bool) -> list[str]:
        """Each conversation through the template, as ``apply_chat_template(..., add_generation_prompt=gen)``."""
        render, variables = self.compiled.render, self.variables
        return [render(messages=[{key: value for key, value in message.items() if value is not None}
                                 for message in messages],
                       tools=None, documents=None, add_generation_prompt=gen, **variables)
                for messages in conversations]


def _plain(messages: Any) -> bool:
    """Whether ``messages`` is a list of dicts of str keys and str or None values, none a reasoning key."""
    return type(messages) is list and all(
        type(message) is dict and REASONING_KEYS.isdisjoint(message)
        and all(type(key) is str and (value is None or type(value) is str) for key, value in message.items())
        for message in messages)


def render_chat(row: dict[str, Any], tokenizer: Any, texts: dict[ChatRender, str] | None = None) -> Rendered:
    """Render with the tokenizer's chat template; every assistant turn (content + end marker) is an answer span.
    ``texts``: this row's renders from :func:`prerender_chats` (else each is one template call here).

    The span of turn i is found by rendering the conversation up to turn i with and without it: the template
    must render a prefix of the conversation as a prefix of the text (true of every common template).
    """
    require_template(tokenizer, "data.format chat", "use data.format alpaca or completion")
    messages = row["messages"]
    if texts is None:  # one template call per render that chat_renders lists
        texts = {(n, gen): tokenizer.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=gen)
                 for n, gen in chat_renders(messages)}

    def upto(n: int, gen: bool) -> str:
        return texts[(n, gen)]

    text = upto(len(messages), False)
    spans = []
    before = ""
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = upto(i, True) if i else ""
        # each prefix is rendered once: the whole conversation is `text`, the last turn's `before` is the prompt
        through = text if i == len(messages) - 1 else upto(i + 1, False)
        if not text.startswith(through) or not through.startswith(before):
            raise DataError("data.format: the chat template does not render conversations prefix-wise; "
                            "cannot locate assistant turns")
        # the turn ends at its end marker: whitespace the template adds after it (e.g. "</s>\n") is not learned
        spans.append((len(before), max(len(before), len(through.rstrip()))))
    last_turn = len(messages) > 1 and messages[-1]["role"] == "assistant"
    prompt = before if last_turn else upto(len(messages) - 1, True)
    return Rendered(text, tuple(spans), prompt, messages[-1]["content"], add_eos=False, templated=True)


def render(row: dict[str, Any], fmt: str, tokenizer: Any, train_on_prompt: bool,
           chat_texts: dict[ChatRender, str] | None = None) -> Rendered:
    """Render one row of ``fmt``; with ``train_on_prompt`` the whole text is one answer span. ``chat_texts``: a
    chat row's renders made beforehand (:func:`prerender_chats`)."""
    if fmt == "alpaca":
        out = render_alpaca(row)
    elif fmt == "completion":
        out = render_completion(row)
    elif fmt == "chat":
        out = render_chat(row, tokenizer, chat_texts)
    else:
        raise ValueError(f"not a causal-LM format: {fmt}")
    if train_on_prompt:
        out = dataclasses.replace(out, spans=((0, len(out.text)),))
    return out


def _chat_answer(messages: list[dict[str, Any]], tokenizer: Any) -> Rendered:
    """One side of a chat-form pair: the whole conversation, with only its final assistant turn as the answer."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = generation_prompt(messages[:-1], tokenizer)
    if not text.startswith(prompt):
        raise DataError("data.format: the chat template does not render conversations prefix-wise; "
                        "cannot locate the final assistant turn of a preference pair")
    # as in render_chat: the turn ends at its end marker, whitespace the template adds after it is not learned
    return Rendered(text, ((len(prompt), max(len(prompt), len(text.rstrip()))),), prompt,
                    messages[-1]["content"], add_eos=False, templated=True)


def render_preference(row: dict[str, Any], tokenizer: Any) -> tuple[Rendered, Rendered]:
    """The chosen and the rejected sample of a checked preference row (see ``check_row``).

    String form ``{prompt, chosen, rejected}``: the prompt is used verbatim (raw: no template is applied, so a
    model fine-tuned on a template gets pairs whose prompt is written in that template), each answer follows it
    directly and ends with the tokenizer's eos. Chat form ``{chosen: [messages], rejected: [messages]}``: both
    conversations are rendered with the chat template; they share every message but the last assistant turn,
    which is the only answer span.
    """
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str):
        prompt = row["prompt"]
        return tuple(  # type: ignore[return-value]
            Rendered(prompt + answer, ((len(prompt), len(prompt) + len(answer)),), prompt, answer, add_eos=True)
            for answer in (chosen, rejected))
    require_template(tokenizer, "preference pairs given as message lists",
                     "write them as {prompt, chosen, rejected} strings")
    return _chat_answer(chosen, tokenizer), _chat_answer(rejected, tokenizer)
