"""finetune.tasks.toolcalls: generated tool calls found in the notations templates write, and compared with the
reference as data (name, and arguments as JSON values), never as text."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from finetune.data.rows import reference_calls
from finetune.tasks import toolcalls

PARIS = ("get_weather", {"city": "Paris", "unit": "C"})


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',  # Hermes, Qwen
    '{"name": "get_weather", "parameters": {"unit": "C", "city": "Paris"}}',  # Llama 3.1 (key order differs)
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]',  # Mistral
    '{"type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", '
    '\\"unit\\": \\"C\\"}"}}',  # the OpenAI shape, arguments as a JSON string
    'I will look it up. {"name":"get_weather","arguments":{"city":"Paris","unit":"C"}} Done.',
])
def test_a_call_is_found_in_each_notation(text: str) -> None:
    assert toolcalls.json_calls(text) == [PARIS]


def test_json_that_is_no_call_is_not_one_and_order_is_kept() -> None:
    text = ('{"note": 1} <tool_call>{"name": "a", "arguments": {}}</tool_call> [1, 2] '
            '<tool_call>{"name": "b", "arguments": {"x": [1, {"y": null}]}}</tool_call> {"name": "no arguments"}')
    assert toolcalls.json_calls(text) == [("a", {}), ("b", {"x": [1, {"y": None}]})]
    assert toolcalls.json_calls("no call here {") == []


def test_a_call_is_correct_when_its_name_and_arguments_are_the_same_data() -> None:
    reference = reference_calls({"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "C", "city": "Paris"}'}}]})
    assert reference is not None and json.loads(reference) == [["get_weather", {"city": "Paris", "unit": "C"}]]
    tok = SimpleNamespace()
    same = '<tool_call>{"name": "get_weather", "arguments": {"city":  "Paris", "unit": "C"}}</tool_call>'
    assert toolcalls.correct(same, reference, tok)
    for wrong in ('<tool_call>{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}</tool_call>',
                  '<tool_call>{"name": "get_time", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>',
                  same + same, "It is sunny."):
        assert not toolcalls.correct(wrong, reference, tok), wrong
    assert reference_calls({"role": "assistant", "content": "text only"}) is None
    assert json.loads(reference_calls({"role": "assistant", "tool_calls": [{"function": {"name": "now"}}]}) or "") \
        == [["now", {}]]


def test_a_tokenizer_with_a_response_schema_parses_its_own_calls() -> None:
    """Where the tokenizer has a response schema, its own parser reads the answer (a notation the JSON scan does
    not know: GPT-OSS's channel)."""
    seen: list[str] = []

    def parse_response(text: str) -> dict[str, Any]:
        seen.append(text)
        return {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]}

    tok = SimpleNamespace(response_schema={"x": 1}, parse_response=parse_response)
    answer = "<|channel|>commentary to=functions.get_weather<|message|>{...}"
    assert toolcalls.parsed_calls(answer, tok) == [PARIS] and seen == [answer]
