"""Prompt rows (data.format: prompt, task grpo): a row's prompt goes through the one prompt-rendering path
(finetune.data.prompts: text as it is, a chat through the template with the generation prompt, the special tokens of
data.add_bos (a chat: exactly apply_chat_template's tokens; a text: the tokenizer's own call's), the end kept over
data.max_seq_len - grpo.max_new_tokens, counted as truncated); every other field is kept for the rewards; bad rows
fail with file:line; PromptCollator left-pads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from finetune.config.schema import DataConfig
from finetune.data import load_splits, prompts
from finetune.data.loading import load_raw
from finetune.data.prompt_rows import PromptCollator, PromptOptions
from finetune.data.tokenize import tokenize_rows
from finetune.errors import DataError

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"
CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 3+3?"}]
ROWS = [{"prompt": "2+2=", "answer": "4", "level": 1},
        {"messages": CHAT, "answer": "6", "level": 2},
        {"prompt": "Count: one two three four five six seven eight nine ten eleven twelve =", "answer": "12"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))


def write(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def tokenized(path: str, tokenizer: Any, max_len: int = 64, new_tokens: int = 8, overlong: str = "truncate",
              require: tuple[str, ...] = ()) -> Any:
    return tokenize_rows(load_raw(path), fmt="prompt", tokenizer=tokenizer, max_len=max_len, overlong=overlong,
                         add_bos="auto", source=path, prompt=PromptOptions(new_tokens), require=require)


def test_text_and_chat_rows_render_through_the_prompts_path(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "p.jsonl", ROWS)
    out = tokenized(path, tokenizer)
    data = out.dataset
    assert data.column_names == ["input_ids", "prompt", "fields", "index", "templated"]
    chat_text = prompts.chat_text(CHAT, tokenizer)
    assert chat_text.endswith(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)[-20:])
    assert data["prompt"] == [ROWS[0]["prompt"], chat_text, ROWS[2]["prompt"]]
    assert data["templated"] == [False, True, False]
    # as the model is served: a text as the tokenizer's own call tokenizes it (this one puts bos first), a chat as
    # apply_chat_template(tokenize=True) does (this template writes no bos); all fit in 64 - 8
    assert data["input_ids"] == [tokenizer(ROWS[0]["prompt"])["input_ids"],
                                 tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False),
                                 tokenizer(ROWS[2]["prompt"])["input_ids"]]
    assert data["input_ids"][0][0] == tokenizer.bos_token_id and data["input_ids"][0].count(tokenizer.bos_token_id) == 1
    assert tokenizer.bos_token_id not in data["input_ids"][1]
    assert [json.loads(f) for f in data["fields"]] == [{"answer": "4", "level": 1}, {"answer": "6", "level": 2},
                                                      {"answer": "12"}]
    assert data["index"] == [0, 1, 2]
    assert out.truncated == 0


def test_a_template_that_writes_bos_gets_no_second_one(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "p.jsonl", [{"prompt": tokenizer.bos_token + "Hi"}])
    ids = tokenized(path, tokenizer).dataset["input_ids"][0]
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids == tokenizer(tokenizer.bos_token + "Hi", add_special_tokens=False)["input_ids"]


def test_a_long_prompt_keeps_its_end_and_is_counted(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "p.jsonl", ROWS)
    full = tokenizer(ROWS[2]["prompt"])["input_ids"]
    room = len(full) - 3  # the third prompt is cut by 3 tokens, the others fit
    assert all(len(tokenizer(r["prompt"])["input_ids"]) <= room for r in (ROWS[0],))
    out = tokenized(path, tokenizer, max_len=room + 8, new_tokens=8)
    assert out.dataset["input_ids"][2] == full[-room:]
    assert out.dataset["prompt"][2] == ROWS[2]["prompt"]  # the text stays whole for the rewards
    assert out.truncated == 1 and out.dropped == 0
    dropped = tokenized(path, tokenizer, max_len=room + 8, new_tokens=8, overlong="drop")
    assert dropped.dropped == 1 and dropped.dataset["index"] == [0, 1]


@pytest.mark.parametrize(("row", "needle"), [
    ({"answer": "4"}, ":2: missing field 'prompt' (prompt rows need prompt (text, or a message list) or messages"),
    ({"prompt": "  ", "answer": "4"}, ":2: field 'prompt' must be a non-empty string"),
    ({"prompt": "a", "messages": CHAT, "answer": "4"}, ":2: both 'prompt' and 'messages' are set"),
    ({"messages": [*CHAT, {"role": "assistant", "content": "6"}], "answer": "6"},
     ":2: the last message is the assistant's, but a prompt row is a chat without its final assistant turn"),
    ({"messages": [{"role": "robot", "content": "x"}], "answer": "6"}, ":2: messages[0] needs role in"),
    ({"prompt": "3+3="}, ":2: missing field 'answer' (the exact_match reward and metric compare"),
])
def test_a_bad_row_is_one_line_with_file_and_line(tmp_path: Path, tokenizer: Any, row: dict, needle: str) -> None:
    path = write(tmp_path / "p.jsonl", [ROWS[0], row])
    with pytest.raises(DataError) as info:
        tokenized(path, tokenizer, require=("answer",))
    assert str(info.value).startswith(path + needle), str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_a_file_without_prompts_or_answers_names_the_field(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "p.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match=r"p\.jsonl:1: missing field 'prompt' \(prompt rows need .* the rows have text"):
        tokenized(path, tokenizer)
    path = write(tmp_path / "q.jsonl", [{"prompt": "x"}])
    with pytest.raises(DataError, match=r"q\.jsonl:1: missing field 'answer' \(the exact_match reward"):
        tokenized(path, tokenizer, require=("answer",))
    path = write(tmp_path / "r.jsonl", [{"prompt": "x"}, ["not", "an", "object"]])
    with pytest.raises(DataError, match=r"r\.jsonl:2: expected a JSON object, got a list"):
        tokenized(path, tokenizer)


def test_load_splits_numbers_sources_and_requires_answers_where_a_reward_needs_them(tmp_path: Path,
                                                                                     tokenizer: Any) -> None:
    first = write(tmp_path / "a.jsonl", ROWS[:2])
    second = write(tmp_path / "b.jsonl", ROWS[2:])
    cfg = DataConfig(format="prompt", train=[{"path": first}, {"path": second}], eval=second, max_seq_len=64)
    bundle = load_splits(cfg, tokenizer, prompt=PromptOptions(8, ("answer",), ("answer",)))
    assert bundle.train.dataset["index"] == [0, 1, 2]
    assert bundle.eval.dataset["index"] == [0]
    assert bundle.train.dataset["input_ids"][0] == tokenizer("2+2=")["input_ids"]
    no_answer = write(tmp_path / "c.jsonl", [{"prompt": "x"}])
    cfg = DataConfig(format="prompt", train=first, eval=no_answer)
    load_splits(cfg, tokenizer, prompt=PromptOptions(8, ("answer",), ()))  # the eval rows need none here
    with pytest.raises(DataError, match=r"c\.jsonl:1: missing field 'answer'"):
        load_splits(cfg, tokenizer, prompt=PromptOptions(8, ("answer",), ("answer",)))


def test_the_collator_left_pads_and_parses_the_fields(tmp_path: Path, tokenizer: Any) -> None:
    data = tokenized(write(tmp_path / "p.jsonl", ROWS), tokenizer).dataset
    rows = [data[i] for i in range(len(data))]
    batch = PromptCollator(pad_id=0)(rows)
    width = max(len(r["input_ids"]) for r in rows)
    assert batch["prompt_ids"].shape == batch["prompt_mask"].shape == (3, width)
    assert batch["prompt_ids"].dtype == batch["prompt_mask"].dtype == batch["index"].dtype == torch.long
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["prompt_ids"][i, width - n:].tolist() == row["input_ids"]
        assert batch["prompt_ids"][i, :width - n].eq(0).all() and batch["prompt_mask"][i, :width - n].eq(0).all()
        assert batch["prompt_mask"][i, width - n:].eq(1).all()
    assert batch["prompts"] == [r["prompt"] for r in rows]
    assert batch["rows"] == [{"answer": "4", "level": 1}, {"answer": "6", "level": 2}, {"answer": "12"}]
    assert batch["index"].tolist() == [0, 1, 2]
    assert batch["templated"] == [False, True, False]


def test_the_truncation_note_names_the_prompt_limit(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "p.jsonl", ROWS)
    room = len(tokenizer(ROWS[2]["prompt"])["input_ids"]) - 3
    bundle = load_splits(DataConfig(format="prompt", train=path, max_seq_len=room + 8), tokenizer,
                         prompt=PromptOptions(8))
    assert bundle.notes(room + 8) == [f"data: 1 prompts truncated (their end kept), 0 dropped (longer than "
                                      f"data.max_seq_len - grpo.max_new_tokens = {room} tokens)"]
