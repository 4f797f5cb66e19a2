"""Training through a model maker's own chat template (read from the installed trl, a test-only dependency):
a template that renders the last turn unlike earlier ones trains, eval's exact_match answers each conversation
once, and ``model.chat_template_kwargs`` reaches every render and the export's template."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import DATA, tiny_recipe

CHATS = [json.loads(line) for line in (DATA / "tiny_chat.jsonl").read_text().splitlines()]


def test_qwen3_with_thinking_off_trains_and_exports_its_switch(tmp_path: Path, train_recipe: Callable) -> None:
    trl = pytest.importorskip("trl")
    template = Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"
    data = str(DATA / "tiny_chat.jsonl")
    run = train_recipe(tiny_recipe(
        name="qwen3-chat",
        model={"chat_template": str(template), "chat_template_kwargs": {"enable_thinking": False}},
        data={"format": "chat", "train": data, "eval": data, "max_seq_len": 256},
        train={"max_steps": 2}, eval={"metrics": ["exact_match"], "every_steps": 2, "max_new_tokens": 4}))
    [last] = [row for row in read_metrics(run) if row["kind"] == "eval"]
    turns = sum(m["role"] == "assistant" for chat in CHATS for m in chat["messages"])
    assert last["eval_samples"] == turns > len(CHATS)  # Qwen3 renders a last turn unlike an earlier one: per turn
    assert last["eval_exact_match_total"] == len(CHATS)  # each conversation's last turn is answered once
    exported = AutoTokenizer.from_pretrained(str(run / "final"))
    prompt = exported.apply_chat_template(CHATS[0]["messages"][:-1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off, fixed in the template
    plain = AutoTokenizer.from_pretrained(str(run / "final"))
    plain.chat_template = template.read_text()
    assert prompt == plain.apply_chat_template(CHATS[0]["messages"][:-1], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=False)
