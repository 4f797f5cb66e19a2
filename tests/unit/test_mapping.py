"""finetune.data.mapping: a source's ``columns`` and ``message_keys`` read it as if written with finetune's names.

The reference is the same rows written with finetune's own names: the tokenized samples must be identical. A
changed mapping reads the other column (never a cached tokenization of the first); mistakes are one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from finetune.config.schema import DataConfig, DataSource
from finetune.data import load_splits
from finetune.errors import DataError


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _samples(tok: Any, fmt: str, path: str, **mapping: Any) -> list[dict[str, Any]]:
    cfg = DataConfig(format=fmt, train=[{"path": path, **mapping}])
    return list(load_splits(cfg, tok).train.dataset)


def test_a_mapped_conversation_is_the_same_as_one_written_with_our_names(tmp_path: Path, tok: Any) -> None:
    theirs = [{"dialog": [{"speaker": "system", "text": "Be brief."}, {"speaker": "human", "text": "2+2?"},
                          {"speaker": "gpt", "text": "4"}], "id": 7}]
    ours = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}], "id": 7}]
    mapped = _samples(tok, "chat", _write(tmp_path / "theirs.jsonl", theirs), columns={"messages": "dialog"},
                      message_keys={"role": "speaker", "content": "text"})
    assert mapped == _samples(tok, "chat", _write(tmp_path / "ours.jsonl", ours))


def test_mapped_pairs_and_alpaca_fields(tmp_path: Path, tok: Any) -> None:
    theirs = [{"question": "Q?", "good": " yes", "bad": " no"}]
    ours = [{"prompt": "Q?", "chosen": " yes", "rejected": " no"}]
    assert _samples(tok, "preference", _write(tmp_path / "p1.jsonl", theirs),
                    columns={"prompt": "question", "chosen": "good", "rejected": "bad"}) == \
        _samples(tok, "preference", _write(tmp_path / "p2.jsonl", ours))
    theirs = [{"task": "Reverse.", "answer": "b a"}]
    ours = [{"instruction": "Reverse.", "output": "b a"}]
    assert _samples(tok, "alpaca", _write(tmp_path / "a1.jsonl", theirs),
                    columns={"instruction": "task", "output": "answer"}) == \
        _samples(tok, "alpaca", _write(tmp_path / "a2.jsonl", ours))


def test_another_mapping_reads_the_other_column(tmp_path: Path, tok: Any) -> None:
    """The mapping is part of what the tokenized cache is keyed by: mapping text to another column of the same
    file gives that column's samples, not the cached ones of the first."""
    path = _write(tmp_path / "two.jsonl", [{"short": "one two", "long": "one two three four five"}])
    first = _samples(tok, "completion", path, columns={"text": "short"})
    second = _samples(tok, "completion", path, columns={"text": "long"})
    assert tok.decode(first[0]["input_ids"]).endswith("one two</s>")
    assert tok.decode(second[0]["input_ids"]).endswith("one two three four five</s>")


def test_mapping_mistakes_are_one_line(tmp_path: Path, tok: Any) -> None:
    path = _write(tmp_path / "rows.jsonl", [{"body": "hi", "text": "there"}])
    with pytest.raises(DataError, match=r"rows\.jsonl: columns maps to 'words', which is not a column of it "
                                        r"\(it has body, text\)"):
        _samples(tok, "completion", path, columns={"text": "words"})
    with pytest.raises(DataError, match=r"has its own 'text' column too"):
        _samples(tok, "completion", path, columns={"text": "body"})
    for mapping, needle in (({"message_keys": {"speaker": "from"}}, "'speaker' is not a message key"),
                            ({"columns": {"text": "a", "prompt": "a"}}, "'a' for two fields")):
        with pytest.raises(ValidationError, match=needle):
            DataSource(path=path, **mapping)
    with pytest.raises(ValidationError, match=r"data\.streaming reads each source as it is written"):
        DataConfig(format="completion", train=[{"path": path, "columns": {"text": "body"}}], streaming=True)
