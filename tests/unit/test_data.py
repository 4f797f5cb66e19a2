"""finetune.data's bundle of tokenized splits: when most rows of a split are longer than a sample may hold, the user
is told on stderr with the counts and the fix (train.log's notes keep every count)."""

from __future__ import annotations

from pathlib import Path

import pytest
from datasets import Dataset

from finetune.data import DataBundle, Part
from finetune.data.tokenize import Tokenized
from tests.cli_helpers import main_exit


def _split(kept: int, truncated: int, dropped: int, no_answer: int = 0) -> Tokenized:
    return Tokenized(Dataset.from_dict({"x": list(range(kept))}), truncated=truncated, dropped=dropped,
                     no_answer=no_answer)


def test_a_split_mostly_longer_than_max_seq_len_is_a_warning_with_its_counts() -> None:
    bundle = DataBundle(train=_split(10, 4, 2), eval=_split(10, 1, 0), labels=None)  # train: 6 of 12, eval: 1 of 10
    assert bundle.warnings(256) == [
        "warning: data.train: 6 of 12 rows are longer than data.max_seq_len = 256 tokens (4 truncated, 2 dropped); "
        "raise data.max_seq_len if the model's context allows, or check the rows"]
    assert DataBundle(train=_split(10, 4, 0), eval=None, labels=None).warnings(256) == []  # 4 of 10: a note only


def test_each_source_and_a_prompt_rows_room_are_named() -> None:
    parts = [Part("data.train[0]", "a.jsonl", _split(3, 3, 0)), Part("data.train[1]", "b.jsonl", _split(5, 0, 0))]
    bundle = DataBundle(train=_split(8, 3, 0), eval=None, labels=None, train_parts=parts, prompt_room=32)
    assert bundle.warnings(128) == [
        "warning: data.train[0] a.jsonl: 3 of 3 rows are longer than data.max_seq_len - grpo.max_new_tokens = 96 "
        "tokens (3 truncated, 0 dropped); raise data.max_seq_len if the model's context allows, or check the rows"]


def test_preprocess_says_it_on_stderr(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                      in_tmp: Path) -> None:
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", "quickstart", "data.max_seq_len=48",
                               "data.overlong=truncate")
    assert code == 0, err
    assert "warning" not in out
    assert "warning: data.train: " in err and "rows are longer than data.max_seq_len = 48 tokens" in err
