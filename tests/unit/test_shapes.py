"""finetune.data.shapes: ShareGPT chat rows read as {role, content} messages, checked against the normalisation
written plainly here; every mistake is one line naming the file, the row and the turn; other formats untouched.
TRL's dataset shapes (prompt-completion, explicit-prompt pairs, conversational prompts) through tokenization, each
checked against its definition written plainly.
(The end-to-end tokenization of ShareGPT rows against the same rows as messages: tests/unit/test_tokenize.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from finetune.data import shapes
from finetune.data.loading import load_raw
from finetune.data.prompt_rows import PromptOptions
from finetune.data.rows import IGNORE
from finetune.data.tokenize import tokenize_rows
from finetune.errors import DataError

# The ShareGPT speaker names and the chat role each is read as, written out here (LLaMA-Factory's sharegpt tags,
# axolotl's default role map, the ShareGPT dumps' model names)
EXPECTED_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "function_call": "assistant",
                  "observation": "tool", "tool": "tool"}
CHAT = shapes.reading("chat")


def plain(row: dict[str, Any]) -> list[dict[str, str]]:
    """The normalisation written plainly: the row's system field (when set) first, then each turn's from by the
    table above and its value as the content."""
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return system + [_plain_turn(t) for t in row["conversations"]]


def _plain_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """A function_call turn is the assistant's tool call (its value the call as JSON); any other is role and
    content."""
    if turn["from"] == "function_call":
        call = json.loads(turn["value"])
        return {"role": "assistant", "content": None,
                "tool_calls": [{"type": "function", "function": {"name": call["name"],
                                                                 "arguments": call.get("arguments", {})}}]}
    return {"role": EXPECTED_ROLES[turn["from"]], "content": turn["value"]}


ROWS = [
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "2+2?"},
                       {"from": "assistant", "value": "4"}]},
    {"system": "You answer in French.",
     "conversations": [{"from": "human", "value": "cat?"}, {"from": "chatgpt", "value": "chat"},
                       {"from": "human", "value": "dog?"}, {"from": "bing", "value": "chien"},
                       {"from": "human", "value": "bird?"}, {"from": "bard", "value": "oiseau"}]},
    {"system": "", "conversations": [{"from": "human", "value": "weather?", "weight": 0},
                                     {"from": "function_call", "value": "{\"name\": \"weather\"}"},
                                     {"from": "observation", "value": "sunny"}, {"from": "tool", "value": "warm"},
                                     {"from": "gpt", "value": "Sunny and warm."}]},
]


def test_the_role_table_is_the_one_written_here() -> None:
    assert shapes.SHAREGPT_ROLES == EXPECTED_ROLES


@pytest.mark.parametrize("row", ROWS)
def test_a_sharegpt_row_reads_as_its_messages(row: dict[str, Any]) -> None:
    out = shapes.normalize_row(row, CHAT, "data.jsonl:1")
    assert out["messages"] == plain(row)
    assert "conversations" not in out


def test_a_row_in_messages_is_left_as_it_is() -> None:
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
           "conversations": None, "system": "not read for a messages row"}
    assert shapes.normalize_row(row, CHAT, "x") is row


def test_a_batch_mixing_both_shapes_converts_row_by_row() -> None:
    """A table whose rows use either shape (their columns are the union, null where a row lacks one): each row
    is read by its own fields; the batch's columns are the format's own (conversations is gone)."""
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    batch = {"messages": [messages, None], "conversations": [None, ROWS[0]["conversations"]], "system": [None, None]}
    out = shapes.normalize_batch(batch, [0, 1], CHAT, "data.jsonl")
    assert set(out) == {"messages", "system"} and out["messages"] == [messages, plain(ROWS[0])]
    plain_batch = {"messages": [messages]}
    assert shapes.normalize_batch(plain_batch, [0], CHAT, "data.jsonl") is plain_batch  # nothing to convert


@pytest.mark.parametrize(("row", "needle"), [
    ({"messages": [{"role": "user", "content": "a"}], "conversations": ROWS[0]["conversations"]},
     "data.jsonl:3: both 'messages' and 'conversations' are set; a row has one of them"),
    ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},
     "data.jsonl:3: conversations[0] has no value; a ShareGPT turn is {from, value}"),
    ({"conversations": [{"from": "human", "value": "a"}, {"value": "x"}]},
     "data.jsonl:3: conversations[1] has no from; a ShareGPT turn is {from, value}"),
    ({"conversations": ["hi"]}, "data.jsonl:3: conversations[0] has no from and value"),
    ({"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]},
     "data.jsonl:3: conversations[0].value must be a string, got 5"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "x"}]},
     "data.jsonl:3: conversations[1].from 'robot' is not a known ShareGPT speaker; use one of system, human, user, "
     "gpt, assistant, chatgpt, bing, bard, function_call, observation, tool"),
    ({"conversations": []}, "data.jsonl:3: field 'conversations' must be a non-empty list of {from, value} turns"),
    ({"conversations": "hi"}, "data.jsonl:3: field 'conversations' must be a non-empty list"),
    ({"system": "a", "conversations": [{"from": "system", "value": "b"}, {"from": "gpt", "value": "x"}]},
     "data.jsonl:3: both a 'system' field and a system turn (conversations[0]); keep one of them"),
    ({"system": 3, "conversations": ROWS[0]["conversations"]}, "data.jsonl:3: field 'system' must be a string"),
])
def test_each_mistake_is_one_line_naming_the_file_and_row(row: dict[str, Any], needle: str) -> None:
    with pytest.raises(DataError) as info:
        shapes.normalize_batch({key: [value] for key, value in row.items()}, [2], CHAT, "data.jsonl")
    assert str(info.value).startswith(needle) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("fmt", ["alpaca", "completion", "classification", "preference", "vision_chat", "prompt"])
def test_only_chat_reads_sharegpt(fmt: str) -> None:
    """vision_chat, preference pairs and the other formats read their own fields only: a conversations field
    changes nothing there (their checks then name the field they miss)."""
    assert shapes.reading(fmt) == () and shapes.columns(fmt, ["conversations"]) == ["conversations"]
    row = {"conversations": ROWS[0]["conversations"]}
    assert shapes.normalize_row(row, shapes.reading(fmt), "x") is row


def test_the_rule_is_read_through_and_changes_with_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a batch function is handed (and so the tokenized cache key) holds the role table: another table is
    another reading."""
    assert [name for name, _ in CHAT] == ["sharegpt", "conversational prompt-completion"]
    assert shapes.columns("chat", ["conversations"]) == ["conversations", "messages"]
    monkeypatch.setitem(shapes.SHAREGPT_ROLES, "bard", "user")
    assert shapes.reading("chat") != CHAT


# ------------------------------------------------------------------ TRL's dataset shapes, through tokenization

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "Four?"}, {"role": "user", "content": "Sure?"}]
COMPLETION = [{"role": "assistant", "content": "Yes, 4."}]


def _tokenized(tmp_path: Path, tok: Any, rows: list[dict[str, Any]], fmt: str, **kwargs: Any) -> list[dict]:
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = {"max_len": 256, "overlong": "truncate", "add_bos": "auto", **kwargs}
    return list(tokenize_rows(load_raw(str(path)), fmt=fmt, tokenizer=tok, source=str(path), **options).dataset)


def _trained(sample: dict[str, Any], tok: Any, side: str = "") -> str:
    ids, labels = sample[f"{side}input_ids"], sample[f"{side}labels"]
    return tok.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE])


def test_string_prompt_completion_trains_the_completion_then_eos(tmp_path: Path, tok: Any) -> None:
    """TRL's prompt-completion rows of text: the sample is prompt + completion (the tokenizer's own special tokens
    first, eos last), and only the completion and the eos are learned."""
    row = {"prompt": "Q: two plus two? A:", "completion": " four"}
    [sample] = _tokenized(tmp_path, tok, [row], "completion")
    assert sample["input_ids"] == tok(row["prompt"] + row["completion"])["input_ids"] + [tok.eos_token_id]
    head = tok(row["prompt"])["input_ids"]
    assert sample["input_ids"][:len(head)] == head  # the prompt's own tokens start the sample (no merge across)
    assert [label for label in sample["labels"] if label != IGNORE] == sample["input_ids"][len(head):]
    assert sample["reference"] == row["completion"]
    [whole] = _tokenized(tmp_path, tok, [row], "completion", train_on_prompt=True)
    assert whole["input_ids"] == sample["input_ids"] and whole["labels"][1:] == whole["input_ids"][1:]


def test_conversational_prompt_completion_trains_what_the_completion_adds(tmp_path: Path, tok: Any) -> None:
    """TRL's definition, written plainly: the completion is the template's render of prompt + completion less the
    render of the prompt with its generation prompt; the prompt's own assistant turn is context, not trained."""
    [sample] = _tokenized(tmp_path, tok, [{"prompt": PROMPT, "completion": COMPLETION}], "chat")
    whole = tok.apply_chat_template(PROMPT + COMPLETION, tokenize=False)
    prompt = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert tok.decode(sample["input_ids"]) == whole
    assert _trained(sample, tok) == whole[len(prompt):].rstrip()
    assert "Four?" not in _trained(sample, tok) and sample["reference"] == "Yes, 4."


def test_a_message_marked_train_false_is_context(tmp_path: Path, tok: Any) -> None:
    row = {"messages": [*PROMPT[:2], {**PROMPT[2], "train": False}, PROMPT[3], *COMPLETION]}
    [sample] = _tokenized(tmp_path, tok, [row], "chat")
    [plain] = _tokenized(tmp_path, tok, [{"prompt": PROMPT, "completion": COMPLETION}], "chat")
    assert sample == plain
    bad = {"messages": [{**PROMPT[1], "train": True}, *COMPLETION]}
    with pytest.raises(DataError, match=r"chat\.jsonl:1: messages\[0\]\.train must be true or false, on an assistant"):
        _tokenized(tmp_path, tok, [bad], "chat")


def test_an_explicit_conversational_prompt_pair_is_the_prompt_before_each_answer(tmp_path: Path, tok: Any) -> None:
    explicit = {"prompt": PROMPT, "chosen": COMPLETION, "rejected": [{"role": "assistant", "content": "No."}]}
    implicit = {"chosen": PROMPT + COMPLETION, "rejected": [*PROMPT, {"role": "assistant", "content": "No."}]}
    assert _tokenized(tmp_path, tok, [explicit], "preference") == _tokenized(tmp_path, tok, [implicit], "preference")


def test_a_conversational_prompt_row_is_its_messages(tmp_path: Path, tok: Any) -> None:
    chat = [{"role": "user", "content": "What is 3+3?"}]
    [written] = _tokenized(tmp_path, tok, [{"prompt": chat, "answer": "6"}], "prompt", prompt=PromptOptions(8))
    [plain] = _tokenized(tmp_path, tok, [{"messages": chat, "answer": "6"}], "prompt", prompt=PromptOptions(8))
    assert written == plain and written["templated"]
    assert written["prompt"] == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("fmt", ["completion", "preference", "chat"])
def test_an_unpaired_preference_row_is_one_line_naming_the_tasks(tmp_path: Path, tok: Any, fmt: str) -> None:
    rows = [{"prompt": "Q?", "completion": " A.", "label": True}]
    with pytest.raises(DataError) as info:
        _tokenized(tmp_path, tok, rows, fmt)
    message = str(info.value)
    assert "unpaired preference" in message and "dpo" in message and "sft" in message and "\n" not in message


def test_a_hermes_tool_call_in_an_answer_becomes_tool_calls() -> None:
    """Hermes function-calling data writes the call inside the gpt turn: each ``<tool_call>`` block becomes a call,
    the text around them the content; a call that is not JSON is one line saying how to write it."""
    row = {"conversations": [{"from": "human", "value": "weather in Paris?"},
                             {"from": "gpt", "value": "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", "
                                                      "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"},
                             {"from": "tool", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}]}
    messages = shapes.normalize_row(row, CHAT, "x.jsonl:1")["messages"]
    assert messages[1] == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2:] == [{"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    bad = {"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "weather(Paris)"}]}
    with pytest.raises(DataError, match=r"^x\.jsonl:1: conversations\[1\]: a tool call must be JSON .*or write the "
                                        r"turn as an assistant message with tool_calls"):
        shapes.normalize_row(bad, CHAT, "x.jsonl:1")
