"""finetune.data.rows: how a row's place and values are named in a one-line error, and the check of a list of chat
turns every data module shares."""

from __future__ import annotations

import json

import pytest

from finetune.data.rows import check_turns, data_suffix, error_detail, line_of, place, short_repr, tools_of
from finetune.errors import DataError


@pytest.mark.parametrize("path,index,where", [
    ("d.jsonl", 0, "d.jsonl:1"),
    ("d.csv", 0, "d.csv:2"),  # the header is line 1
    ("d.parquet", 4, "d.parquet (row 5)"),  # no lines: the row number
    ("d.jsonl.gz", 2, "d.jsonl.gz:3"),  # a compressed file's lines are its text's
    ("d.csv.zst", 0, "d.csv.zst:2"),
    ("d.json.bz2", 1, "d.json.bz2 (row 2)"),
])
def test_line_of_names_the_line_a_user_opens(path: str, index: int, where: str) -> None:
    assert line_of(path, index) == where


def test_data_suffix_looks_past_a_compression_suffix() -> None:
    assert [data_suffix(p) for p in ("a.jsonl", "a.jsonl.gz", "a.csv.xz", "dir.v2/a.parquet", "a.tar.gz", "a")] == [
        ".jsonl", ".jsonl", ".csv", ".parquet", ".tar", ""]


def test_a_placed_source_names_its_rows_where_it_was_told() -> None:
    """A source that is not one whole file (a folder, a glob, a slice) says where its rows are; forgetting it gives
    the whole-file rule back."""
    place("repo (split=test)", lambda index: f"repo/test.jsonl:{index + 11}")
    try:
        assert line_of("repo (split=test)", 0) == "repo/test.jsonl:11"
        assert line_of("repo", 0) == "repo (row 1)"
    finally:
        place("repo (split=test)", None)
    assert line_of("repo (split=test)", 0) == "repo (split=test) (row 1)"


def test_short_repr_keeps_a_huge_value_on_one_short_line() -> None:
    assert short_repr("abc") == "'abc'"
    assert short_repr("x" * 100, limit=10) == "'xxxxxx..."


def test_error_detail_is_the_first_line_of_the_innermost_message() -> None:
    try:
        try:
            raise ValueError("the real cause\nand more")
        except ValueError as inner:
            raise RuntimeError("generic wrapper") from inner
    except RuntimeError as outer:
        assert error_detail(outer) == "the real cause"
    assert error_detail(StopIteration()) == "StopIteration"


@pytest.mark.parametrize("value,message", [
    ([], "f.jsonl:3: field 'messages' must be a non-empty list"),
    ("hi", "f.jsonl:3: field 'messages' must be a non-empty list"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "f.jsonl:3: messages[1] needs role"),
    ([{"role": "user", "content": 7}], "f.jsonl:3: messages[0] needs role"),
])
def test_check_turns_names_the_first_bad_message(value: object, message: str) -> None:
    with pytest.raises(DataError) as info:
        check_turns(value, "f.jsonl:3")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    check_turns([{"role": "system", "content": ""}, {"role": "assistant", "content": "ok"}], "f.jsonl:3")


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
USER = {"role": "user", "content": "weather?"}


@pytest.mark.parametrize(("messages", "needle"), [
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{city: Paris}"}}]}],
     r"messages\[1\]\.tool_calls\[0\] \(f\): arguments are not valid JSON"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
     r"messages\[1\]\.tool_calls\[0\] needs a function name"),
    ([USER, {"role": "assistant", "tool_calls": []}], r"messages\[1\]\.tool_calls must be a non-empty list"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}],
     r"messages\[1\]\.tool_calls\[0\] \(f\): arguments must be an object"),
    ([USER, {"role": "tool", "content": "sunny"}], r"messages\[1\] is a tool result with no tool call before it"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], r"messages\[0\] is a user message with tool_calls"),
    ([USER, {"role": "assistant", "content": None}], r"messages\[1\] needs role in .* and a string content"),
    ([USER, {"role": "user", "content": "x", "train": True}], r"messages\[1\]\.train must be true or false, on an "
                                                              r"assistant turn"),
])
def test_a_bad_tool_row_is_one_line(messages: list, needle: str) -> None:
    with pytest.raises(DataError, match=r"^rows\.jsonl:3: " + needle) as info:
        check_turns(messages, "rows.jsonl:3")
    assert "\n" not in str(info.value)


def test_a_tool_conversation_in_the_openai_shape_is_well_formed() -> None:
    check_turns([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                 {"role": "tool", "content": "sunny", "tool_call_id": "1"},
                 {"role": "assistant", "tool_calls": [{"function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
                 {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Sunny.", "train": True}],
                "rows.jsonl:1")


def test_tools_are_a_list_of_schemas_or_its_json() -> None:
    schema = {"type": "function", "function": {"name": "f"}}
    assert tools_of({"tools": [schema]}, "x") == [schema]
    assert tools_of({"tools": json.dumps([schema])}, "x") == [schema]
    assert tools_of({}, "x") is None and tools_of({"tools": []}, "x") is None
    for bad, needle in (("[oops", "is a string but not JSON"), ({"name": "f"}, "must be a list of tool schemas")):
        with pytest.raises(DataError, match=r"^rows\.jsonl:2: field 'tools' " + needle):
            tools_of({"tools": bad}, "rows.jsonl:2")
