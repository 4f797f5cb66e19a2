"""finetune.data.detect: a source's format read from its columns when data.format is left out.

Each of TRL's dataset shapes (and the instruction formats) is written as a file, loaded as ``datasets`` loads it,
and read for the task that trains it; ambiguous or foreign columns are one line. Validation fills the format a
task or model row has only one of; a causal LM's sft reads each source's own, said once per source.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from finetune.config.schema import CAUSAL_FORMATS, DataConfig
from finetune.data import detect, load_splits
from finetune.data.loading import load_raw
from finetune.errors import DataError
from tests.config_helpers import errors_of

SFT = frozenset(CAUSAL_FORMATS)
USER = [{"role": "user", "content": "2+2?"}]
ANSWER = [{"role": "assistant", "content": "4"}]
# (a row, the format it is read as for the tasks that train it, the shape's name), as TRL's guide names them
SHAPES = [
    ({"text": "The sky is blue."}, SFT, "completion", "language modeling"),
    ({"messages": USER + ANSWER}, SFT, "chat", "conversational"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, SFT, "chat",
     "ShareGPT conversations"),
    ({"prompt": "2+2=", "completion": "4"}, SFT, "completion", "prompt-completion"),
    ({"prompt": USER, "completion": ANSWER}, SFT, "chat", "conversational prompt-completion"),
    ({"instruction": "Add.", "input": "2 2", "output": "4"}, SFT, "alpaca", "alpaca"),
    ({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, frozenset({"preference"}), "preference", "preference pairs"),
    ({"chosen": USER + ANSWER, "rejected": [*USER, {"role": "assistant", "content": "5"}]},
     frozenset({"preference"}), "preference", "preference pairs"),
    ({"prompt": "2+2=", "answer": "4"}, frozenset({"prompt"}), "prompt", "prompt-only"),
    ({"messages": USER, "answer": "4"}, frozenset({"prompt"}), "prompt", "conversational"),
    ({"text": "good", "label": "pos"}, frozenset({"classification"}), "classification", "classification"),
    ({"messages": USER + ANSWER}, frozenset({"vision_chat"}), "vision_chat", "conversational"),
]


def _raw(tmp_path: Path, rows: list[dict[str, Any]]) -> Any:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_raw(str(path))


@pytest.mark.parametrize(("row", "allowed", "fmt", "shape"), SHAPES, ids=[s[3] + "-" + s[2] for s in SHAPES])
def test_each_shape_is_read_as_its_format(tmp_path: Path, row: dict, allowed: frozenset, fmt: str,
                                          shape: str) -> None:
    raw = _raw(tmp_path, [row])
    assert detect.detect(raw.column_names, raw.features, allowed, "rows.jsonl") == (fmt, shape)


def test_foreign_ambiguous_and_unpaired_columns_are_one_line(tmp_path: Path) -> None:
    cases = [
        ([{"question": "q", "reply": "r"}], SFT, r"rows\.jsonl: its columns \(question, reply\) fit no row shape this "
                                                 r"task reads; the task reads .*conversational \(messages\)"),
        ([{"chosen": "a", "rejected": "b", "prompt": "p"}], SFT, r"fit preference pairs, which this task does not "
                                                                 r"train"),
        ([{"messages": USER + ANSWER, "text": "also"}], SFT, r"fit more than one row shape \(conversational, "
                                                             r"language modeling\); set data\.format"),
        ([{"prompt": "p", "completion": "c", "label": True}], SFT, r"unpaired preference \(KTO's shape"),
    ]
    for rows, allowed, needle in cases:
        raw = _raw(tmp_path, rows)
        with pytest.raises(DataError, match=needle) as info:
            detect.detect(raw.column_names, raw.features, allowed, "rows.jsonl")
        assert "\n" not in str(info.value)


def test_a_left_out_format_is_read_per_source_and_said_once(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[2] / "finetune" / "assets" /
                                            "tiny-llama-tokenizer"))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": USER, "completion": ANSWER}) + "\n")
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "The sky is blue."}) + "\n")
    bundle = load_splits(DataConfig(train=[{"path": str(chat)}, {"path": str(text)}], eval=str(text)), tok)
    assert bundle.detected == [
        f"data.train[0] {chat}: conversational prompt-completion, 1 rows (data.format left out: read from its columns)",
        f"data.train[1] {text}: language modeling, 1 rows (data.format left out: read from its columns)",
        f"data.eval {text}: language modeling, 1 rows (data.format left out: read from its columns)"]
    explicit = load_splits(DataConfig(format="chat", train=str(chat)), tok)
    assert explicit.detected == [] and list(explicit.train.dataset) == list(bundle.train_parts[0].tokenized.dataset)


def test_validation_fills_the_format_a_task_has_one_of(write_recipe, minimal_recipe) -> None:
    """dpo / reward read preference pairs and grpo prompt rows: a left-out format is theirs; a stream cannot be
    read ahead, so it needs one."""
    from finetune.config import load_recipe

    recipe = minimal_recipe
    recipe["data"].pop("format")
    cfg, _ = load_recipe(write_recipe(recipe))
    assert cfg.data.format is None  # a causal LM's sft: each source's own
    assert load_recipe(write_recipe({**recipe, "task": "dpo"}), weights=False)[0].data.format == "preference"
    streamed = {**recipe, "data": {**recipe["data"], "streaming": True},
                "train": {**recipe.get("train", {}), "max_steps": 2}}
    assert any("data.streaming reads no source ahead" in line for line in errors_of(write_recipe(streamed)))
