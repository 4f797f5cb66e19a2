"""finetune.data.shapes: ShareGPT chat rows read as {role, content} messages, checked against the normalisation
written plainly here; every mistake is one line naming the file, the row and the turn; other formats untouched.
(The end-to-end tokenization of ShareGPT rows against the same rows as messages: tests/unit/test_tokenize.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from finetune.data import shapes
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
    return system + [{"role": EXPECTED_ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]


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
    assert [name for name, _ in CHAT] == ["sharegpt"] and shapes.columns("chat", ["conversations"]) == \
        ["conversations", "messages"]
    monkeypatch.setitem(shapes.SHAREGPT_ROLES, "bard", "user")
    assert shapes.reading("chat") != CHAT
