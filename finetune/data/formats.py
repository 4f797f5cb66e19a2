"""Render raw rows of each causal-LM format into text plus the character spans the model learns.

Masking works on characters, not on separately tokenized pieces: the whole sample is tokenized once with
offsets, and a token is trained on when it starts inside an answer span. That keeps BPE merges at the
prompt/answer boundary identical to what the model sees at inference time.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta

from finetune.data.rows import reference_calls, tools_of
from finetune.data.shapes import explicit_pair
from finetune.errors import DataError

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass(frozen=True)
class Rendered:
    """A rendered sample: ``text`` to tokenize, answer ``spans`` in it, and the prompt/reference for generation.

    ``add_eos`` says the tokenizer's eos token must be appended (and trained on) after ``text``; chat templates
    already end assistant turns with their own end marker. ``templated``: ``text`` (and ``prompt``) are a chat
    template's render, which wrote every special token it wants (:mod:`finetune.data.bos` adds none before them).
    ``reference`` None: a sample of a chat row's earlier turns, which eval's exact_match does not count (it answers
    each row's last turn). ``calls``: the tool calls of a chat row's last turn, as JSON
    (:func:`finetune.data.rows.reference_calls`), what the ``tool_calls`` metric compares with; None without.
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    prompt: str
    reference: str | None
    add_eos: bool
    templated: bool = False
    calls: str | None = None


def render_alpaca(row: dict[str, Any]) -> Rendered:
    template = ALPACA_PROMPT_INPUT if (row.get("input") or "").strip() else ALPACA_PROMPT
    prompt = template.format(instruction=row["instruction"], input=row.get("input") or "")
    answer = row["output"]
    return Rendered(prompt + answer, ((len(prompt), len(prompt) + len(answer)),), prompt, answer, add_eos=True)


def render_completion(row: dict[str, Any]) -> Rendered:
    """A ``{text}`` row: the whole text is learned. A string prompt-completion row (``{prompt, completion}``, TRL's
    shape): the completion is learned after the prompt, as TRL trains it (``prompt + completion``, then eos)."""
    if row.get("text") is None and row.get("completion") is not None:
        prompt, answer = row["prompt"], row["completion"]
        return Rendered(prompt + answer, ((len(prompt), len(prompt) + len(answer)),), prompt, answer, add_eos=True)
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


def generation_prompt(messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None = None
                      ) -> str:
    """``messages`` as a model gets them to write the assistant's turn: through the tokenizer's chat template with
    its generation prompt, cut where the template's rendered turns part from it (:func:`serving_prompt`). The
    prompt of a chat row's turns in training, of chat preference pairs, and what :mod:`finetune.data.prompts`
    renders for eval, generate and GRPO: one text for all of them."""
    require_template(tokenizer, "a prompt written as messages", "write the prompt as text")
    check_tools(tokenizer, tools)
    messages = for_template(messages)
    return serving_prompt(render_one(messages, (len(messages), GEN), tokenizer, tools),
                          render_one(messages, (len(messages), PROBE), tokenizer, tools))


def check_tools(tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
    """Rows with ``tools`` need a chat template that renders them: one that never reads ``tools`` would drop
    them silently, so it is refused (a :class:`RowProblem`, naming the fix)."""
    if tools and "tools" not in template_variables(tokenizer):
        raise RowProblem("the row has tools, but the chat template never renders tools (it does not read "
                         f"'tools'); give a template that supports tool calling ({TEMPLATE_FIX})")


# A chat row's renders, each (prefix length n, kind) of ``messages[:n]`` through the chat template: TEXT as it is,
# GEN with the generation prompt, PROBE followed by the probe assistant turn (:func:`serving_prompt`)
ChatRender = tuple[int, str]
TEXT, GEN, PROBE = "text", "gen", "probe"
# The assistant turn a serving prompt is found with: its content starts with a character no template writes in a
# generation prompt, so the text it shares with the generation prompt ends where the turn's own text begins
PROBE_TURN: dict[str, str] = {"role": "assistant", "content": "\x00"}


class RowProblem(Exception):
    """A row the chat template renders but that cannot be trained as it would be served: the message is a whole
    sentence (:func:`finetune.data.batched.rendered` puts the row's place before it)."""


def conversation(messages: list[dict[str, Any]], key: ChatRender) -> list[dict[str, Any]]:
    """The messages a render ``key`` renders: ``messages[:n]``, followed by the probe turn for PROBE."""
    n, kind = key
    return [*messages[:n], PROBE_TURN] if kind == PROBE else messages[:n]


def render_one(messages: list[dict[str, Any]], key: ChatRender, tokenizer: Any,
               tools: list[dict[str, Any]] | None = None) -> str:
    """One render ``key`` of ``messages`` (one ``apply_chat_template`` call, ``tools`` given to the template)."""
    return tokenizer.apply_chat_template(conversation(messages, key), tools=tools, tokenize=False,
                                         add_generation_prompt=key[1] == GEN)


def serving_prompt(gen: str, probe: str) -> str:
    """The text a model answers after: the longest common start of the generation prompt (``gen``) and the same
    conversation followed by an assistant turn (``probe``). Most templates write a turn right after their
    generation prompt, so this is the generation prompt; a template whose generation prompt prefills what its
    rendered turns do not hold (DeepSeek-R1's ``<think>\\n``) is cut where the two part (see
    :func:`prefill_dropped`)."""
    return common_start(gen, probe)


def common_start(a: str, b: str) -> str:
    """The longest common start of ``a`` and ``b``: ``a`` itself when ``b`` starts with it (one comparison, the
    usual case), else found by halving (each step one string comparison, never a loop over characters)."""
    if b.startswith(a):
        return a
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; a[:high + 1] != b[:high + 1]
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return a[:low]


ONE_MESSAGE = [{"role": "user", "content": "Hi"}]  # the conversation a template's own habits are read from


def prefill_dropped(tokenizer: Any) -> str:
    """What the template's generation prompt writes that its rendered assistant turns do not start with (``""`` for
    most templates; DeepSeek-R1's ``<think>\\n``), found on a one-message conversation: the part
    :func:`generation_prompt` leaves out."""
    gen = render_one(ONE_MESSAGE, (1, GEN), tokenizer)
    return gen[len(serving_prompt(gen, render_one(ONE_MESSAGE, (1, PROBE), tokenizer))):]


def ends_turns(tokenizer: Any) -> bool:
    """Whether the template writes an end marker after an assistant turn's content (nearly all do; GLM-4.5's
    original template ends a turn only where the next message begins, so a last turn ends with its content)."""
    return not render_one(ONE_MESSAGE, (1, PROBE), tokenizer).rstrip().endswith(PROBE_TURN["content"])


def turn_end_id(tokenizer: Any) -> int | None:
    """The token the chat template ends an assistant turn with, when it is one of the tokenizer's added tokens
    (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``, ``<|return|>``): the first token after the
    probe turn's content. None without a template, without an end marker, or when the marker is ordinary text."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = render_one(ONE_MESSAGE, (1, PROBE), tokenizer)
    except Exception:  # a template that cannot render a one-message conversation: rows say why themselves
        return None
    at = text.rfind(PROBE_TURN["content"])
    after = text[at + len(PROBE_TURN["content"]):].lstrip() if at >= 0 else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    token = added.get(ids[0])
    return ids[0] if token is not None and after.startswith(str(token)) else None


def stop_ids(tokenizer: Any) -> list[int]:
    """What generation stops at (eval's exact_match, ``finetune generate``, GRPO): the tokenizer's eos and the
    chat template's end-of-turn token (:func:`turn_end_id`), so a model served with a template stops where its
    trained turns end even when the tokenizer's eos is another token (Gemma's ``<eos>`` after
    ``<end_of_turn>``, a base tokenizer given chatml)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = [] if eos is None else [eos]
    end = turn_end_id(tokenizer)
    return ids + ([end] if end is not None and end not in ids else [])


def template_warnings(tokenizer: Any) -> list[str]:
    """One line for each habit of the tokenizer's chat template that training cannot match with serving: a
    generation prompt that prefills what its turns do not hold (:func:`prefill_dropped`: the choice finetune makes,
    and the template's switches that may avoid it), and turns without an end marker (:func:`ends_turns`: nothing
    teaches the model to stop). None for no template, or one that cannot render a one-message conversation (the
    rows say why themselves)."""
    try:
        if not getattr(tokenizer, "chat_template", None):
            return []
        dropped, ended = prefill_dropped(tokenizer), ends_turns(tokenizer)
    except Exception:  # a template that raises for this conversation: each row's own error says why
        return []
    lines = []
    if dropped:
        switches = [name for name in template_variables(tokenizer) if "think" in name or "reason" in name]
        hint = (f"; the template reads {', '.join(switches)}: model.chat_template_kwargs sets them" if switches
                else "; model.chat_template gives a template whose turns start with it")
        lines.append(f"warning: the chat template's generation prompt ends with {dropped!r}, which its rendered "
                     "assistant turns do not start with; finetune trains each turn as rendered and generates (eval, "
                     "generate, GRPO) from the prompt without it; a server using the template's own generation "
                     f"prompt adds it{hint}")
    if not ended:
        lines.append("warning: the chat template writes nothing after an assistant turn's content (no end marker), "
                     "so a trained last turn teaches the model no end: it may not stop where it should; "
                     "model.chat_template gives a template that ends each turn (e.g. with the next role's token)")
    return lines


def template_variables(tokenizer: Any) -> list[str]:
    """The names the tokenizer's chat template reads that no renderer gives it (its switches, such as
    ``enable_thinking``; and ``tools``, where it renders them), sorted; none when it cannot be parsed."""
    template = tokenizer.chat_template
    texts = tuple(template.values()) if isinstance(template, dict) else (template,)
    return list(_variables(texts))


@functools.lru_cache(maxsize=16)
def _variables(texts: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`template_variables` of template texts, parsed once per text (rows ask for each)."""
    names: set[str] = set()
    try:
        for text in texts:  # transformers' {% generation %} tags (training templates) mean nothing here
            plain = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", text)
            names |= meta.find_undeclared_variables(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
                                                    .parse(plain))
    except Exception:  # a template jinja2 alone cannot parse (a transformers extension tag): no hint
        return ()
    return tuple(sorted(names))


TRAIN_KEY = "train"  # a message's own say in whether it is trained (false: an assistant turn kept as context)


@dataclass(frozen=True)
class ChatRule:
    """Which parts of a chat row's assistant turns are trained (``data.train_turns``, ``data.train_reasoning``):
    ``last_only``, only the last assistant turn (else every one); ``reasoning``, a turn's reasoning trace too
    (else the characters of the trace, as its message gives it, are left out of the turn's trained text). A
    message's own ``train: true / false`` overrides the turn choice. Part of the tokenized cache key."""

    last_only: bool = False
    reasoning: bool = True

    @classmethod
    def of(cls, cfg: Any) -> ChatRule:
        """The rule of a recipe's ``data`` section (``data.train_turns``, ``data.train_reasoning``)."""
        return cls(last_only=cfg.train_turns == "last", reasoning=cfg.train_reasoning)


EVERY_TURN = ChatRule()  # the defaults: every assistant turn, reasoning included


def trained_turns(messages: list[dict[str, Any]], rule: ChatRule = EVERY_TURN) -> list[int]:
    """The indices of the assistant turns a chat row trains: each whose message says ``train: true``, and the
    others not marked ``train: false`` (with ``rule.last_only``: the last assistant turn only)."""
    turns = [i for i, msg in enumerate(messages) if msg.get("role") == "assistant"]
    last = turns[-1:] if rule.last_only else turns
    return [i for i in turns if messages[i].get(TRAIN_KEY) is True
            or (messages[i].get(TRAIN_KEY) is not False and i in last)]


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The reasoning trace a message carries (``reasoning_content``, ``thinking`` or ``reasoning``, as
    transformers reads them), stripped; None when it has none."""
    for key in ("reasoning_content", "thinking", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _without(text: str, span: tuple[int, int], part: str | None) -> list[tuple[int, int]]:
    """``span`` of ``text`` less the first occurrence of ``part`` inside it (the whole span when it is not in it)."""
    start, end = span
    at = text.find(part, start, end) if part else -1
    if at < 0:
        return [span]
    return [piece for piece in ((start, at), (at + len(part), end)) if piece[1] > piece[0]]


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as the chat template gets them: without finetune's ``train`` key, and a tool call's arguments
    written as a JSON string given as the object it holds (what transformers documents and the templates render;
    checked to parse by :func:`finetune.data.rows.check_tool_calls`). The messages themselves when neither applies,
    so the usual row costs nothing."""
    if not any(TRAIN_KEY in msg or msg.get("tool_calls") for msg in messages):
        return messages
    return [{key: (_calls(value) if key == "tool_calls" else value) for key, value in msg.items() if key != TRAIN_KEY}
            for msg in messages]


def _calls(calls: Any) -> Any:
    """Tool calls with each JSON-string ``arguments`` parsed (see :func:`for_template`)."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
        out.append(call)
    return out


def chat_renders(messages: list[dict[str, Any]], rule: ChatRule = EVERY_TURN) -> list[ChatRender]:
    """The renders :func:`render_chat` needs for ``messages``: for each trained assistant turn i (the last
    message when none is), the conversation up to and with it (the last is the whole conversation), and for i > 0
    the conversation before it with the generation prompt and with the probe turn (its serving prompt)."""
    needed: list[ChatRender] = []
    for i in trained_turns(messages, rule) or [len(messages) - 1]:
        needed += [(i + 1, TEXT)] + ([(i, GEN), (i, PROBE)] if i else [])
    return needed


def prerender_chats(conversations: list[Any], tokenizer: Any, rule: ChatRule = EVERY_TURN
                    ) -> list[dict[ChatRender, str]] | None:
    """Every render :func:`render_chat` needs for each of ``conversations``: through the tokenizer's compiled
    template directly where that is provably what ``apply_chat_template`` renders (:class:`TemplateRenderer`),
    else in two batched ``apply_chat_template`` calls (one per ``add_generation_prompt``): the same template
    function on the same messages either way. None when any conversation is not a well-formed message list or the
    template raises for one: the caller then renders row by row, so a bad row is reported as it always was (which
    row, and after the checks of the rows before it)."""
    try:
        wanted = [chat_renders(messages, rule) for messages in conversations]
        conversations = [for_template(messages) for messages in conversations]
        keys = {gen: [(row, key) for row, needed in enumerate(wanted) for key in needed if (key[1] == GEN) == gen]
                for gen in (False, True)}
        direct = TemplateRenderer.of(tokenizer, conversations)
        out: list[dict[ChatRender, str]] = [{} for _ in conversations]
        for gen, rows in keys.items():
            if not rows:
                continue
            chats = [conversation(conversations[row], key) for row, key in rows]
            texts = direct.render(chats, gen) if direct is not None else None
            if texts is None or [texts[0]] != tokenizer.apply_chat_template(chats[:1], tokenize=False,
                                                                            add_generation_prompt=gen):
                texts = tokenizer.apply_chat_template(chats, tokenize=False, add_generation_prompt=gen)
            if not isinstance(texts, list) or len(texts) != len(rows) or not all(isinstance(t, str) for t in texts):
                return None
            for (row, key), text in zip(rows, texts, strict=True):
                out[row][key] = text
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


def render_chat(row: dict[str, Any], tokenizer: Any, texts: dict[ChatRender, str] | None = None,
                rule: ChatRule = EVERY_TURN) -> list[Rendered]:
    """The training samples of a chat row: every assistant turn trained as the template renders it as the final
    turn, after its serving prompt. ``texts``: this row's renders from :func:`prerender_chats` (else each is one
    template call here).

    Turn i's sample is the conversation up to and with turn i; its trained span runs from the end of the serving
    prompt of the messages before it (:func:`generation_prompt`: what generate, eval and GRPO give the model)
    to the end of its text (the end marker: whitespace the template writes after it is not learned). Turns share
    one sample while each earlier sample is a start of the next one's serving prompt: a template that renders a
    conversation prefix-wise gives one sample per row; one that renders the last turn differently (reasoning
    dropped from earlier turns, an end token only after the last) gives one sample per assistant turn, each
    trained on its own last turn only. A turn whose text does not continue its serving prompt cannot be trained as
    it would be served: :class:`RowProblem`.
    """
    require_template(tokenizer, "data.format chat", "use data.format alpaca or completion")
    trained = trained_turns(row["messages"], rule)
    messages = for_template(row["messages"])
    tools = tools_of(row, "the row")
    check_tools(tokenizer, tools)
    if texts is None or tools:  # one template call per render that chat_renders lists (tools: each row its own)
        texts = {key: render_one(messages, key, tokenizer, tools) for key in chat_renders(row["messages"], rule)}
    samples: list[tuple[str, tuple[tuple[int, int], ...], str, int]] = []  # text, spans, prompt, last turn
    for i in trained or [len(messages) - 1]:  # none trained: the last turn's sample (it trains nothing)
        text = texts[(i + 1, TEXT)]
        prompt = serving_prompt(texts[(i, GEN)], texts[(i, PROBE)]) if i else ""
        if not text.startswith(prompt):
            raise RowProblem(_discontinued(messages, i, prompt, text))
        span = answer_span(prompt, text) if i in trained else (len(prompt), len(prompt))
        # data.train_reasoning false: the trace's own characters are not trained, the rest of the turn is
        spans = tuple(_without(text, span, None if rule.reasoning else reasoning_of(row["messages"][i])))
        if samples and prompt.startswith(samples[-1][0]):
            samples[-1] = (text, (*samples[-1][1], *spans), prompt, i)
        else:
            samples.append((text, spans, prompt, i))
    # eval's exact_match answers each row's last turn: a sample of earlier turns has no reference
    last = len(samples) - 1
    return [Rendered(text, spans, prompt, messages[turn].get("content") if k == last else None, add_eos=False,
                     templated=True, calls=reference_calls(messages[turn]) if k == last else None)
            for k, (text, spans, prompt, turn) in enumerate(samples)]


def _discontinued(messages: list[dict[str, Any]], turn: int, prompt: str, text: str) -> str:
    """Why turn ``turn`` cannot be trained: the template renders it as ``text``, which does not go on from the
    serving ``prompt``."""
    at = len(common_start(prompt, text))
    written = "with its reasoning " if REASONING_KEYS.intersection(messages[turn]) else ""
    return (f"the chat template writes messages[{turn}] {written}as {text[at:at + 40]!r}... where the prompt it "
            f"answers after goes on with {prompt[at:at + 40]!r}, so it cannot be trained as it would be served; "
            "a template that renders no reasoning takes turns without it (or choose one that renders it, "
            "model.chat_template, or its switch, model.chat_template_kwargs)")


def render(row: dict[str, Any], fmt: str, tokenizer: Any, train_on_prompt: bool,
           chat_texts: dict[ChatRender, str] | None = None, rule: ChatRule = EVERY_TURN) -> list[Rendered]:
    """The samples of one row of ``fmt``: one, or one per group of a chat row's assistant turns
    (:func:`render_chat`). With ``train_on_prompt`` the whole text is trained: a chat row is then one sample, the
    whole conversation as the template renders it. ``chat_texts``: a chat row's renders made beforehand
    (:func:`prerender_chats`); ``rule``: which parts of a chat row's assistant turns are trained."""
    if fmt == "alpaca":
        out = [render_alpaca(row)]
    elif fmt == "completion":
        out = [render_completion(row)]
    elif fmt == "chat":
        out = render_chat(row, tokenizer, chat_texts, rule)
    else:
        raise ValueError(f"not a causal-LM format: {fmt}")
    if train_on_prompt:
        out = [dataclasses.replace(out[-1], spans=((0, len(out[-1].text)),))]
    return out


def _chat_answer(messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None = None
                 ) -> Rendered:
    """One side of a chat-form pair: the whole conversation, with only its final assistant turn as the answer,
    after its serving prompt (as :func:`render_chat` trains a last turn)."""
    text = tokenizer.apply_chat_template(for_template(messages), tools=tools, tokenize=False)
    prompt = generation_prompt(messages[:-1], tokenizer, tools)
    if not text.startswith(prompt):
        raise RowProblem(_discontinued(messages, len(messages) - 1, prompt, text))
    return Rendered(text, (answer_span(prompt, text),), prompt, messages[-1].get("content"), add_eos=False,
                    templated=True)


def answer_span(prompt: str, text: str) -> tuple[int, int]:
    """The characters of ``text`` a chat answer trains: from the end of its serving ``prompt`` to its end marker
    (whitespace the template writes after the marker, e.g. ``</s>\\n``, is not learned)."""
    return len(prompt), max(len(prompt), len(text.rstrip()))


def render_preference(row: dict[str, Any], tokenizer: Any) -> tuple[Rendered, Rendered]:
    """The chosen and the rejected sample of a checked preference row (see ``check_row``).

    String form ``{prompt, chosen, rejected}``: the prompt is used verbatim (raw: no template is applied, so a
    model fine-tuned on a template gets pairs whose prompt is written in that template), each answer follows it
    directly and ends with the tokenizer's eos. Chat form ``{chosen: [messages], rejected: [messages]}`` (or with an
    explicit ``prompt: [messages]`` before both): both conversations are rendered with the chat template; they
    share every message but the last assistant turn, which is the only answer span.
    """
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str):
        prompt = row["prompt"]
        return tuple(  # type: ignore[return-value]
            Rendered(prompt + answer, ((len(prompt), len(prompt) + len(answer)),), prompt, answer, add_eos=True)
            for answer in (chosen, rejected))
    require_template(tokenizer, "preference pairs given as message lists",
                     "write them as {prompt, chosen, rejected} strings")
    row = explicit_pair(row)  # an explicit conversational prompt: before each answer
    tools = tools_of(row, "the row")
    return _chat_answer(row["chosen"], tokenizer, tools), _chat_answer(row["rejected"], tokenizer, tools)
