"""finetune.storage.record: what a checkpoint's or export's manifest records for the commands that open it (the
row, the classification label names), and how a folder written before is opened without the training data."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune import registry
from finetune.errors import RunDirError
from finetune.storage.record import labels_of, record, row_of


def _cfg(labels: list[str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(type="bert"), task=None, data=SimpleNamespace(labels=labels))


def test_the_row_and_labels_recorded_are_the_ones_read_back(tmp_path: Path) -> None:
    row = registry.get_model("bert")
    manifest = json.loads(json.dumps(record(_cfg(), row, ["neg", "pos"])))  # as written and read back
    assert manifest["row"]["model_type"] == "bert" and row_of(manifest, _cfg()) == row
    assert labels_of(manifest, _cfg(["other"]), row, tmp_path) == ["neg", "pos"]  # the manifest wins


def test_a_folder_written_before_falls_back_to_the_recipe_then_its_config_then_one_line(tmp_path: Path) -> None:
    row = registry.get_model("bert")
    assert row.task == "classification"
    assert labels_of({}, _cfg(["a", "b"]), row, tmp_path) == ["a", "b"]
    with pytest.raises(RunDirError, match="records no classification labels") as info:
        labels_of({}, _cfg(), row, tmp_path)
    assert "\n" not in str(info.value)
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"1": "pos", "0": "neg"}}))
    assert labels_of({}, _cfg(), row, tmp_path) == ["neg", "pos"]
    assert labels_of({}, _cfg(), registry.get_model("llama"), tmp_path) is None  # not a classification row


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"id2label": {"x": "pos"}}'])
def test_a_damaged_config_json_is_the_one_line_not_a_traceback(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(RunDirError, match="records no classification labels"):
        labels_of({}, _cfg(), registry.get_model("bert"), tmp_path)
