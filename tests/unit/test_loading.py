"""finetune.data.loading: bad datasets give one DataError line naming the file (and line), bad rows name their line
and field, and classification works from every file type.

Each case writes a small file to ``tmp_path`` in one of the four supported types and runs it through the same
functions the trainer uses (``load_raw``, ``check_columns``, ``label_names``, ``tokenize_rows``, ``load_splits``).
A bad input must raise :class:`DataError` (nothing else, no traceback for the CLI to print) whose message is a
single line starting with ``file`` or ``file:line``.
"""

from __future__ import annotations

import builtins
import bz2
import csv
import gzip
import json
import lzma
import os
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from finetune.config.schema import DataConfig
from finetune.data import load_splits
from finetune.data.batching import Collator
from finetune.data.loading import check_columns, check_rows, load_raw
from finetune.data.tokenize import label_names, tokenize_rows
from finetune.errors import DataError
from tests.data_files import write_jsonl

TOKENIZER = Path(__file__).resolve().parents[2] / "finetune" / "assets" / "tiny-llama-tokenizer"
KINDS = ("csv", "jsonl", "json", "parquet")
GOOD = {
    "alpaca": {"instruction": "Say hi.", "output": "hi"},
    "completion": {"text": "A short sentence."},
    "classification": {"text": "hello there", "label": "greet"},
    "chat": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
}


def write(tmp_path: Path, kind: str, rows: list[dict[str, Any]], name: str = "train") -> str:
    """``rows`` as ``<name>.<kind>``: one object per line, a JSON list, a csv with a header, or parquet."""
    path = tmp_path / f"{name}.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows, indent=1))
    elif kind == "csv":
        fields = list(dict.fromkeys(key for row in rows for key in row))
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def where(path: str, index: int) -> str:
    """Where row ``index`` is reported: jsonl lines, csv lines after the header, else the row number."""
    if path.endswith(".jsonl"):
        return f"{path}:{index + 1}"
    if path.endswith(".csv"):
        return f"{path}:{index + 2}"
    return f"{path} (row {index + 1})"


def one_line(excinfo: pytest.ExceptionInfo[DataError], prefix: str, *parts: str) -> str:
    """The error's message, checked to be a single line that starts with ``prefix`` and contains ``parts``."""
    message = str(excinfo.value)
    assert excinfo.type is DataError
    assert "\n" not in message, message
    assert message.startswith(prefix), message
    for part in parts:
        assert part in message, message
    return message


def classify(path: str, tok: Any, labels: list[str] | None = None) -> tuple[list[str], Any]:
    """The brief's reproduction: load, name the labels, tokenize, and collate every row."""
    raw = load_raw(path)
    check_columns(raw, "classification", path)
    names = label_names(raw, labels, path)
    out = tokenize_rows(raw, fmt="classification", tokenizer=tok, max_len=32, overlong="truncate", add_bos="auto",
                        labels=names,
                        source=path)
    return names, out


# ------------------------------------------------------------------ 1. classification from every file type


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("values", "names"), [(["greet", "leave", "greet"], ["greet", "leave"]),
                                               ([1, 0, 2], ["0", "1", "2"])], ids=["text", "int"])
def test_classification_batches_have_int64_labels_from_every_file_type(
        tmp_path: Path, tok: Any, kind: str, values: list[Any], names: list[str]) -> None:
    path = write(tmp_path, kind, [{"text": t, "label": v} for t, v in zip(["hello there", "bye now", "hi"], values,
                                                                          strict=True)])
    got_names, out = classify(path, tok)
    assert got_names == names
    features = out.dataset.features
    assert features["label"].dtype == "int64"
    assert features["input_ids"].feature.dtype.startswith("int")
    batch = Collator(tok.pad_token_id)(list(out.dataset))
    assert batch["label"].dtype == torch.int64
    assert [names[i] for i in batch["label"].tolist()] == [str(v) for v in values]


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_causal_output_types_do_not_follow_same_named_source_columns(tmp_path: Path, tok: Any, kind: str) -> None:
    """A source column called ``labels``/``reference`` (strings) must not retype the tokenized columns."""
    rows = [{**GOOD["alpaca"], "labels": "x", "reference": "y", "prompt_ids": "z"}] * 2
    path = write(tmp_path, kind, rows)
    out = tokenize_rows(load_raw(path), fmt="alpaca", tokenizer=tok, max_len=64, overlong="truncate", add_bos="auto",
                        source=path)
    assert out.dataset.features["labels"].feature.dtype == "int64"
    batch = Collator(tok.pad_token_id, with_prompts=True)(list(out.dataset))
    assert batch["labels"].dtype == torch.int64 and batch["reference"] == ["hi", "hi"]


def test_string_labels_that_look_like_ids_keep_their_own_classes(tmp_path: Path, tok: Any) -> None:
    """Names "1", "2", "3" are classes 0, 1, 2; they must not be read as ids (which merged "2" and "3")."""
    path = write(tmp_path, "jsonl", [{"text": t, "label": v} for t, v in (("a", "1"), ("b", "2"), ("c", "3"))])
    names, out = classify(path, tok)
    assert names == ["1", "2", "3"]
    assert out.dataset["label"] == [0, 1, 2]


# ----------------------------------------------------------------------------- 2. fewer than two classes


@pytest.mark.parametrize(("kind", "value", "shown"), [("csv", "greet", "'greet'"), ("jsonl", "greet", "'greet'"),
                                                       ("json", 0, "0"), ("parquet", "greet", "'greet'")])
def test_a_single_class_is_refused(tmp_path: Path, tok: Any, kind: str, value: Any, shown: str) -> None:
    path = write(tmp_path, kind, [{"text": f"row {i}", "label": value} for i in range(4)])
    with pytest.raises(DataError) as excinfo:
        classify(path, tok)
    one_line(excinfo, path, "at least two distinct labels", f"found only {shown} (in 4 rows)")


def test_configured_labels_allow_a_train_file_that_uses_one_of_them(tmp_path: Path, tok: Any) -> None:
    path = write(tmp_path, "csv", [{"text": f"row {i}", "label": "greet"} for i in range(4)])
    names, out = classify(path, tok, labels=["greet", "leave"])
    assert names == ["greet", "leave"] and out.dataset["label"] == [0] * 4


@pytest.mark.parametrize("labels", [["greet"], ["greet", "leave", "greet"]], ids=["one", "duplicate"])
def test_configured_labels_must_name_two_distinct_classes(tmp_path: Path, tok: Any, labels: list[str]) -> None:
    path = write(tmp_path, "jsonl", [{"text": "a", "label": "greet"}, {"text": "b", "label": "leave"}])
    with pytest.raises(DataError) as excinfo:
        classify(path, tok, labels=labels)
    one_line(excinfo, "data.labels: ")


# ----------------------------------------------------------------------------- 3. label values of the wrong type

WRONG = "field 'label' must be a label name or an integer id, got "


@pytest.mark.parametrize(("kind", "bad", "shown"), [
    ("jsonl", [1, 2], "[1, 2]"),
    ("jsonl", {"id": 1}, "{'id': 1}"),
    ("jsonl", 1.5, "1.5"),
    ("jsonl", True, "True"),
    ("jsonl", -1, "-1"),
    ("json", [1, 2], "[1, 2]"),
    ("json", False, "False"),
])
def test_wrong_label_type_among_names_names_its_row(tmp_path: Path, tok: Any, kind: str, bad: Any,
                                                     shown: str) -> None:
    rows = [{"text": "a", "label": "greet"}, {"text": "b", "label": "leave"}, {"text": "c", "label": bad}]
    path = write(tmp_path, kind, rows)
    with pytest.raises(DataError) as excinfo:
        classify(path, tok)
    one_line(excinfo, where(path, 2), WRONG + shown)


@pytest.mark.parametrize(("kind", "values", "row", "expected"), [
    ("jsonl", [0, 1, 1.5], 2, WRONG + "1.5"),  # ints + one float: the whole column is read as floats
    ("jsonl", [0, 1, 2.0], 2, WRONG + "2.0"),  # a whole-number float: the row that has it, not row 0
    ("csv", [0, 1, 1.5], 2, WRONG + "1.5"),
    ("csv", [0, 1, "2.0"], 2, WRONG + "2.0"),
    ("csv", [0, "", 1], 1, "missing field 'label'"),  # one blank cell turns the ids into floats
    ("csv", ["true", "false"], 0, WRONG + "True"),
    ("jsonl", ["greet", None, "leave"], 1, "missing field 'label'"),
    ("parquet", [[1], [2]], 0, WRONG + "[1]"),
    ("parquet", [0.5, 1.5], 0, WRONG + "0.5"),
])
def test_labels_read_as_another_type_name_the_row_as_written(tmp_path: Path, tok: Any, kind: str, values: list[Any],
                                                             row: int, expected: str) -> None:
    path = write(tmp_path, kind, [{"text": f"t{i}", "label": v} for i, v in enumerate(values)])
    with pytest.raises(DataError) as excinfo:
        classify(path, tok)
    one_line(excinfo, where(path, row), expected)


def test_eval_labels_get_the_same_type_check(tmp_path: Path, tok: Any) -> None:
    train = write(tmp_path, "jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}])
    evals = write(tmp_path, "jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": ["y"]}], name="eval")
    with pytest.raises(DataError) as excinfo:
        load_splits(DataConfig(format="classification", train=train, eval=evals), tok)
    one_line(excinfo, f"{evals}:2", WRONG + "['y']")


def test_mixed_types_are_found_by_line_when_datasets_cannot_load_them(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Older ``datasets`` fail on a column mixing lists and strings; the scan after the failure names the line."""
    path = write(tmp_path, "jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"},
                                     {"text": "c", "label": [1, 2]}])

    def fail(*args: Any, **kwargs: Any) -> None:
        raise datasets.exceptions.DatasetGenerationError("An error occurred while generating the dataset")

    monkeypatch.setattr(datasets.DatasetBuilder, "download_and_prepare", fail)  # what load_dataset reads with
    with pytest.raises(DataError) as excinfo:
        load_raw(path)
    one_line(excinfo, f"{path}:3", "field 'label' is a list here but a string on line 1")


def test_label_names_without_a_label_column_is_a_data_error(tmp_path: Path) -> None:
    """``finetune.runtime.peft`` calls label_names straight after load_raw: a missing column must not be a KeyError."""
    path = write(tmp_path, "jsonl", [{"text": "a", "category": "x"}])
    with pytest.raises(DataError) as excinfo:
        label_names(load_raw(path), None, path)
    one_line(excinfo, f"{path}:1", "missing field 'label'", "the rows have text, category")


# -------------------------------------------------------------------------------------------------- 4. encodings


@pytest.mark.parametrize(("kind", "content", "line"), [
    ("jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', 2),
    ("csv", b"text,label\na,0\ncaf\xe9,1\n", 3),
    ("json", b'[{"text": "a"},\n {"text": "caf\xe9"}]', 2),
])
def test_latin1_file_names_line_and_offset(tmp_path: Path, kind: str, content: bytes, line: int) -> None:
    path = tmp_path / f"train.{kind}"
    path.write_bytes(content)
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    offset = content.index(0xE9)
    one_line(excinfo, f"{path}:{line}: not UTF-8 text", "byte 0xe9", f"file offset {offset}")


def test_utf16_file_says_so(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes('{"text": "a"}\n'.encode("utf-16"))
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, str(path), "not UTF-8 text", "UTF-16")


@pytest.mark.parametrize("kind", ["jsonl", "csv", "json"])
def test_utf8_bom_is_accepted(tmp_path: Path, kind: str) -> None:
    path = write(tmp_path, kind, [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}])
    Path(path).write_bytes(b"\xef\xbb\xbf" + Path(path).read_bytes())
    raw = load_raw(path)
    check_columns(raw, "classification", path)
    assert raw["text"] == ["a", "b"] and label_names(raw, None, path) == ["x", "y"]


def test_bom_does_not_hide_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n{"text": "c",}\n')
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, f"{path}:3: invalid JSON")


# --------------------------------------------------------------------------------------- 5. unreadable inputs


@pytest.mark.parametrize("kind", KINDS)
def test_directory_with_a_data_suffix_is_read_as_a_folder(tmp_path: Path, kind: str) -> None:
    """A folder is a folder of data files whatever its name says, as for datasets.load_dataset(folder)."""
    path = tmp_path / f"train.{kind}"
    path.mkdir()
    (path / "part-0.jsonl").write_text(json.dumps(GOOD["completion"]) + "\n")
    assert load_raw(str(path)).to_list() == datasets.load_dataset(str(path), split="train").to_list()


@pytest.mark.parametrize("kind", KINDS)
def test_unreadable_file(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, kind, [GOOD["completion"]] * 2)
    os.chmod(path, 0)
    if os.geteuid() == 0:  # root reads anything: make open() refuse the file as the OS does for other users
        real_open = builtins.open

        def refusing_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            if str(file) == path:
                raise PermissionError(13, "Permission denied", path)
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", refusing_open)
    try:
        with pytest.raises(DataError) as excinfo:
            load_raw(path)
    finally:
        os.chmod(path, 0o644)
    one_line(excinfo, path, "Permission denied")


def _fifo(tmp_path: Path) -> str:
    os.mkfifo(tmp_path / "train.jsonl")
    return str(tmp_path / "train.jsonl")


def _zero_link(tmp_path: Path) -> str:
    (tmp_path / "train.jsonl").symlink_to("/dev/zero")
    return str(tmp_path / "train.jsonl")


@pytest.mark.parametrize(("make", "kind"), [(_fifo, "a named pipe"), (_zero_link, "a character device"),
                                            (lambda tmp_path: "/dev/zero", "a character device")],
                         ids=["fifo", "link-to-dev-zero", "dev-zero"])
def test_a_pipe_or_a_device_is_not_a_regular_file(tmp_path: Path, make: Any, kind: str) -> None:
    """Reading one would block or never end; the line says what it is, not "not found" or "unsupported type"."""
    path = make(tmp_path)
    with pytest.raises(DataError) as excinfo:
        load_raw(path)
    one_line(excinfo, f"{path}: not a regular file ({kind}); name one ")


@pytest.mark.parametrize("header", ["instruction,output,output", "output,instruction,output"])
def test_a_csv_header_that_names_a_column_twice_is_refused(tmp_path: Path, header: str) -> None:
    """datasets renamed the second column to 'output.1' and trained on the first without a word."""
    path = tmp_path / "train.csv"
    path.write_text(f"{header}\nSay hi.,hi,bye\n")
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, f"{path}:1: the header names the column 'output' twice; give each column its own name")


def test_corrupt_parquet(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, str(path), "cannot be read as parquet", "Parquet magic bytes")


@pytest.mark.parametrize(("fmt", "header"), [("classification", ["text", "lbl"]), ("alpaca", ["instruction", "out"]),
                                             ("completion", ["body"])])
def test_csv_header_without_a_required_column(tmp_path: Path, fmt: str, header: list[str]) -> None:
    path = write(tmp_path, "csv", [dict.fromkeys(header, "1"), dict.fromkeys(header, "2")])
    with pytest.raises(DataError) as excinfo:
        check_columns(load_raw(path), fmt, path)
    one_line(excinfo, f"{path}:1: the header has no column", f"the header has {', '.join(header)}")


@pytest.mark.parametrize(("fmt", "bad", "expected"), [
    ("alpaca", {"instruction": "Say hi."}, "missing field 'output'"),
    ("alpaca", {"instruction": "Say hi.", "output": ["hi"]}, "field 'output' must be a non-empty string"),
    ("alpaca", {"instruction": "Say hi.", "output": "hi", "input": 3}, "field 'input' must be a string"),
    ("completion", {"text": 5}, "field 'text' must be a non-empty string"),
    ("completion", {"body": "x"}, "missing field 'text'"),
    ("classification", {"label": "greet"}, "missing field 'text'"),
    ("classification", {"text": "hey", "label": {"name": "greet"}}, WRONG),
    ("chat", {"messages": "hi"}, "field 'messages' must be a non-empty list"),
    ("chat", {"messages": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "messages[0] needs role"),
    ("chat", {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "b"}]},
     "messages[0] needs role"),
    ("chat", {"messages": [["user", "hi"], ["assistant", "hello"]]}, "messages[0] needs role"),
    ("chat", {"messages": [{"role": "user", "content": "a"}]}, "the last message must be the assistant's"),
])
@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_a_later_bad_row_names_its_line(tmp_path: Path, tok: Any, kind: str, fmt: str, bad: dict[str, Any],
                                        expected: str) -> None:
    second = {"text": "bye", "label": "leave"} if fmt == "classification" else GOOD[fmt]
    path = write(tmp_path, kind, [GOOD[fmt], second, bad])
    with pytest.raises(DataError) as excinfo:
        load_splits(DataConfig(format=fmt, train=path), tok)
    one_line(excinfo, where(path, 2), expected)


@pytest.mark.parametrize(("fmt", "rows", "expected"), [
    ("alpaca", [GOOD["alpaca"], {"instruction": "Go.", "output": ""}], "missing field 'output'"),
    ("classification", [GOOD["classification"], {"text": "", "label": "leave"}], "missing field 'text'"),
    ("completion", [{**GOOD["completion"], "id": "1"}, {"text": "  ", "id": "2"}],
     "field 'text' must be a non-empty string"),
])
def test_a_later_bad_csv_row_names_its_line(tmp_path: Path, tok: Any, fmt: str, rows: list[dict[str, Any]],
                                            expected: str) -> None:
    path = write(tmp_path, "csv", rows)
    with pytest.raises(DataError) as excinfo:
        load_splits(DataConfig(format=fmt, train=path), tok)
    one_line(excinfo, f"{path}:3: ", expected)


@pytest.mark.parametrize(("name", "content", "prefix", "expected"), [
    ("train.csv", "text,label\na,x\nb,y,z\nc,x\n", ":3: ", "3 fields but the header has 2"),  # pandas can't
    ("train.csv", "text,label\n", ": ", "no rows"),
    ("train.json", '[{"text": "a"},\n {"text": "b"},\n 7]', " (row 3)", "expected a JSON object, got a number"),
    ("train.json", '[{"text": "a"},\n {"text": }]', ":2", "invalid JSON"),  # a JSON list with a bad item
])
def test_csv_or_json_list_that_cannot_be_read(tmp_path: Path, name: str, content: str, prefix: str,
                                              expected: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, f"{path}{prefix}", expected)


def test_chat_template_that_rejects_a_conversation_names_the_line(tmp_path: Path) -> None:
    strict = AutoTokenizer.from_pretrained(str(TOKENIZER))
    strict.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]}
    path = write(tmp_path, "jsonl", [GOOD["chat"], twice])
    with pytest.raises(DataError) as excinfo:
        load_splits(DataConfig(format="chat", train=path), strict)
    one_line(excinfo, f"{path}:2: the tokenizer's chat template rejects this conversation",
             "Conversation roles must alternate")


@pytest.mark.parametrize(("content", "expected"), [
    ("5", "the file holds a number"),
    ('"rows"', "the file holds a string"),
    ('["a", "b"]', "its first item is a string"),
    ("[1, 2]", "its first item is a number"),
    ("[[1], [2]]", "its first item is a list"),
    ("[]", "no rows"),
])
def test_json_that_is_not_a_list_of_objects(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "train.json"
    path.write_text(content)
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, str(path), expected)




@pytest.mark.parametrize(("content", "line"), [
    (b'{"text": "a"}\n\n{"text": "b"}\n', 2),
    (b'{"text": "a"}\n \t\r\n{"text": "b"}\n', 2),
    (b'\n{"text": "a"}\n', 1),
    (b'\xef\xbb\xbf\n{"text": "a"}\n', 1),
    (b'{"text": "a"}\n{"text": "b"}\n  ', 3),
])
def test_blank_jsonl_lines_are_refused_by_line(tmp_path: Path, content: bytes, line: int) -> None:
    """Blank lines would shift every later line number (datasets skips them), wherever they are."""
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, f"{path}:{line}: empty line")


def test_jsonl_starting_with_a_list_names_line_1(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('["a", "b"]\n{"text": "c"}\n')
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, f"{path}:1: expected a JSON object", "a list")


# -------------------------------------------------------------------------------- 6. bad rows: file, line and field


def test_missing_field_names_file_line_and_field(tmp_path: Path) -> None:
    ok = json.dumps({"instruction": "a", "output": "b"})
    path = write_jsonl(tmp_path / "d.jsonl", [ok, ok, json.dumps({"instruction": "a"}), ok])
    with pytest.raises(DataError, match=rf"{path}:3: missing field 'output'"):
        check_rows(load_raw(path), "alpaca", path)


def test_missing_column_everywhere_reports_line_1(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"instruction": "a"})] * 2)
    with pytest.raises(DataError, match=rf"{path}:1: missing field 'output'"):
        check_rows(load_raw(path), "alpaca", path)


def test_invalid_json_names_line(tmp_path: Path) -> None:
    ok = json.dumps({"text": "a"})
    path = write_jsonl(tmp_path / "d.jsonl", [ok, ok, ok, '{"text": "a",}', ok])
    with pytest.raises(DataError, match=rf"{path}:4: invalid JSON"):
        load_raw(path)


def test_empty_line_names_line(tmp_path: Path) -> None:
    ok = json.dumps({"text": "a"})
    path = write_jsonl(tmp_path / "d.jsonl", [ok, "", ok])
    with pytest.raises(DataError, match=rf"{path}:2: empty line"):
        load_raw(path)


def test_non_object_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "a"}), "[1, 2]"])
    with pytest.raises(DataError, match=rf"{path}:2: expected a JSON object"):
        load_raw(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match="no rows"):
        load_raw(str(path))


def test_wrong_type_names_line_and_field(tmp_path: Path) -> None:
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": "b"}, {"instruction": "a", "output": 5}]
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(DataError, match=rf"{path}:3: field 'output' must be a non-empty string"):
        check_rows(load_raw(path), "alpaca", path)
    rows = [{"instruction": "a", "output": "b", "input": ["x"]}]
    path = write_jsonl(tmp_path / "e.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(DataError, match=rf"{path}:1: field 'input' must be a string"):
        check_rows(load_raw(path), "alpaca", path)
    path = write_jsonl(tmp_path / "f.jsonl", [json.dumps({"instruction": "  ", "output": "b"})])
    with pytest.raises(DataError, match=rf"{path}:1: field 'instruction' must be a non-empty string"):
        check_rows(load_raw(path), "alpaca", path)


def test_chat_message_without_role(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [json.dumps(good), json.dumps(bad)])
    with pytest.raises(DataError, match=rf"{path}:2: messages\[1\] needs role"):
        check_rows(load_raw(path), "chat", path)
    unknown = {"messages": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "r.jsonl", [json.dumps(unknown)])
    with pytest.raises(DataError, match=rf"{path}:1: messages\[0\] needs role"):
        check_rows(load_raw(path), "chat", path)


def test_chat_last_message_must_be_assistant(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"messages": [*good["messages"], {"role": "user", "content": "c"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [json.dumps(good), json.dumps(good), json.dumps(bad)])
    with pytest.raises(DataError, match=rf"{path}:3: the last message must be the assistant"):
        check_rows(load_raw(path), "chat", path)
    path = write_jsonl(tmp_path / "e.jsonl", [json.dumps({"messages": []})])
    with pytest.raises(DataError, match=rf"{path}:1: field 'messages' must be a non-empty list"):
        check_rows(load_raw(path), "chat", path)


def test_csv_bad_row_line_counts_header(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("text,label\nfine,0\nalso fine,1\n,2\n")  # index 2 -> line 4
    with pytest.raises(DataError, match=rf"{path}:4: missing field 'text'"):
        check_rows(load_raw(str(path)), "classification", str(path))


def test_unsupported_suffix_and_missing_file(tmp_path: Path) -> None:
    txt = tmp_path / "d.txt"
    txt.write_text("hello\n")
    with pytest.raises(DataError, match="unsupported data file type"):
        load_raw(str(txt))
    with pytest.raises(DataError, match="not found"):
        load_raw(str(tmp_path / "missing.jsonl"))


def test_bool_label_is_rejected(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "a", "label": True})])
    with pytest.raises(DataError, match=rf"{path}:1: field 'label'"):
        check_rows(load_raw(path), "classification", path)


# ---------------------------------------------------------- 8. local sources: folders, saved folders, globs, slices


OPENERS: dict[str, Any] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def _texts(path: Path, texts: list[str]) -> str:
    """Rows ``{"text": t}`` as JSON lines, compressed as the suffix says (.gz, .bz2, .xz)."""
    with OPENERS.get(path.suffix, open)(path, "wt") as handle:
        handle.write("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def _repo(tmp_path: Path) -> Path:
    """A cloned hub dataset: train in two files (one compressed), validation in one, and a README."""
    folder = tmp_path / "repo"
    (folder / "data").mkdir(parents=True)
    _texts(folder / "data" / "train-00000-of-00002.jsonl", [f"a{i}" for i in range(3)])
    _texts(folder / "data" / "train-00001-of-00002.jsonl.gz", [f"b{i}" for i in range(2)])
    _texts(folder / "data" / "validation-00000-of-00001.jsonl", [f"v{i}" for i in range(2)])
    (folder / "README.md").write_text("# a dataset\n")
    return folder


@pytest.mark.parametrize("split", ["train", "validation", "train[1:]+validation", "train[:40%]", "validation[-1:]"])
def test_a_folder_reads_as_load_dataset_reads_it(tmp_path: Path, split: str) -> None:
    folder = str(_repo(tmp_path))
    assert load_raw(folder, split=split).to_list() == datasets.load_dataset(folder, split=split).to_list()


def test_a_folder_without_split_names_is_train(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    for name in ("one", "two"):
        rows = datasets.Dataset.from_list([{"text": f"{name}{i}"} for i in range(2)])
        rows.to_parquet(str(folder / f"{name}.parquet"))
    raw = load_raw(str(folder))
    assert raw.to_list() == datasets.load_dataset(str(folder), split="train").to_list()
    with pytest.raises(DataError) as excinfo:
        load_raw(str(folder), split="test")
    one_line(excinfo, f"{folder}: no split 'test'; the splits there are train")


def test_a_missing_split_names_the_splits_found(tmp_path: Path) -> None:
    folder = _repo(tmp_path)
    with pytest.raises(DataError) as excinfo:
        load_raw(str(folder), split="test[:10]")
    one_line(excinfo, f"{folder}: no split 'test'; the splits there are train, validation")


@pytest.mark.parametrize(("make", "expected"), [
    (lambda tmp_path: tmp_path, "holds no data files datasets can read"),
    (lambda tmp_path: (tmp_path / "notes.txt").write_text("hello\n") and tmp_path, "its data files are .txt files"),
], ids=["empty", "text-files"])
def test_a_folder_without_data_files_is_one_line(tmp_path: Path, make: Any, expected: str) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    make(folder)
    with pytest.raises(DataError) as excinfo:
        load_raw(str(folder))
    one_line(excinfo, f"{folder}: ", expected)


def test_a_bad_row_of_a_folder_names_its_file_and_line(tmp_path: Path) -> None:
    folder = _repo(tmp_path)
    bad = folder / "data" / "train-00001-of-00002.jsonl.gz"
    _texts(bad, ["b0", ""])  # the empty text of its 2nd line
    with pytest.raises(DataError) as excinfo:
        check_rows(load_raw(str(folder)), "completion", str(folder))
    one_line(excinfo, f"{bad}:2: field 'text' must be a non-empty string")


def test_a_bad_row_of_a_slice_names_its_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"text": t}) for t in ("a", "b", "c", "", "e")])
    name = f"{path} (split=train[2:])"
    with pytest.raises(DataError) as excinfo:
        check_rows(load_raw(path, split="train[2:]"), "completion", name)
    one_line(excinfo, f"{path}:4: field 'text' must be a non-empty string")


@pytest.mark.parametrize("split", ["train", "validation", "train[:2]+validation[1:]", "train[50%:]"])
def test_a_saved_dataset_dict_reads_as_load_from_disk_and_slices_as_load_dataset(tmp_path: Path, split: str) -> None:
    """The same rows as jsonl files give the reference slice: a saved folder is sliced as load_dataset slices."""
    rows = {"train": [f"r{i}" for i in range(5)], "validation": ["v0", "v1"]}
    datasets.DatasetDict({name: datasets.Dataset.from_list([{"text": t} for t in texts])
                          for name, texts in rows.items()}).save_to_disk(str(tmp_path / "saved"))
    files = {name: _texts(tmp_path / f"{name}.jsonl", texts) for name, texts in rows.items()}
    raw = load_raw(str(tmp_path / "saved"), split=split)
    assert raw.to_list() == datasets.load_dataset("json", data_files=files, split=split).to_list()
    if "+" not in split and "[" not in split:
        assert raw.to_list() == datasets.load_from_disk(str(tmp_path / "saved"))[split].to_list()


def test_a_saved_dataset_is_the_split_train(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": f"r{i}"} for i in range(4)]).save_to_disk(str(saved))
    assert load_raw(str(saved)).to_list() == datasets.load_from_disk(str(saved)).to_list()
    raw = load_raw(str(saved), split="train[1:3]")
    assert raw["text"][:] == ["r1", "r2"]
    with pytest.raises(DataError) as excinfo:
        check_rows(raw, "classification", f"{saved} (split=train[1:3])")
    one_line(excinfo, f"{saved} (row 2): ")  # the row's number in the saved split
    with pytest.raises(DataError) as excinfo:
        load_raw(str(saved), split="test")
    one_line(excinfo, f"{saved}: no split 'test'; the splits there are train")


def test_a_saved_folder_that_cannot_be_written_is_copied_for_the_tokenized_cache(
        tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """map writes its cache beside the rows' files: a read-only saved folder gets a copy in the datasets cache."""
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": f"row {i}"} for i in range(3)]).save_to_disk(str(saved))
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == saved else real(path, mode))
    raw = load_raw(str(saved))
    assert Path(raw.cache_files[0]["filename"]).parent == Path(datasets.config.HF_DATASETS_CACHE) / "finetune-saved"
    out = tokenize_rows(raw, fmt="completion", tokenizer=tok, max_len=32, overlong="truncate", add_bos="auto",
                        source=str(saved))
    assert not list(saved.glob("cache-*.arrow")) and len(out.dataset) == 3


@pytest.mark.parametrize("pattern", ["*.jsonl", "train-*", "**/*.jsonl*"])
def test_a_glob_reads_as_load_dataset_reads_its_pattern(tmp_path: Path, pattern: str) -> None:
    _texts(tmp_path / "train-1.jsonl", ["a", "b"])
    _texts(tmp_path / "train-2.jsonl", ["c"])
    (tmp_path / "deep").mkdir()
    _texts(tmp_path / "deep" / "more.jsonl.gz", ["d"])
    source = str(tmp_path / pattern)
    assert load_raw(source).to_list() == datasets.load_dataset("json", data_files=source, split="train").to_list()


def test_a_glob_of_several_types_or_none_is_one_line(tmp_path: Path) -> None:
    _texts(tmp_path / "a.jsonl", ["a"])
    write(tmp_path, "csv", [{"text": "b"}], name="b")
    with pytest.raises(DataError) as excinfo:
        load_raw(str(tmp_path / "*"))
    one_line(excinfo, f"{tmp_path / '*'}: matches files of more than one type (json: 1, csv: 1)")
    with pytest.raises(DataError) as excinfo:
        load_raw(str(tmp_path / "*.parquet"))
    one_line(excinfo, f"{tmp_path / '*.parquet'}: no file matches this pattern")


def test_a_bad_line_of_a_glob_names_its_file(tmp_path: Path) -> None:
    _texts(tmp_path / "a.jsonl", ["a"])
    bad = write_jsonl(tmp_path / "b.jsonl", [json.dumps({"text": "b"}), '{"text": ', json.dumps({"text": "c"})])
    with pytest.raises(DataError) as excinfo:
        load_raw(str(tmp_path / "*.jsonl"))
    one_line(excinfo, f"{bad}:2: invalid JSON")


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_a_compressed_file_reads_as_load_dataset_reads_it(tmp_path: Path, suffix: str) -> None:
    path = _texts(tmp_path / f"rows.jsonl{suffix}", ["a", "b", "c"])
    assert load_raw(path).to_list() == datasets.load_dataset("json", data_files=path, split="train").to_list()
    csv_path = tmp_path / f"rows.csv{suffix}"
    with OPENERS[suffix](csv_path, "wt") as handle:
        handle.write("text,label\nhello,a\nbye,b\n")
    assert load_raw(str(csv_path)).to_list() == datasets.load_dataset("csv", data_files=str(csv_path),
                                                                      split="train").to_list()


@pytest.mark.parametrize(("content", "expected"), [
    (b'{"text": "a"}\n\n{"text": "b"}\n', ":2: empty line"),
    (b'{"text": "a"}\n{"text": "caf\xe9"}\n', ":2: not UTF-8 text"),
    (b'{"text": "a"}\n{"text": "b"\n', ":2: invalid JSON"),
], ids=["blank-line", "latin1", "bad-json"])
def test_a_compressed_jsonl_file_is_checked_as_its_text(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(content))
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, f"{path}{expected}")


def test_a_bad_row_of_a_compressed_jsonl_file_names_its_line(tmp_path: Path) -> None:
    path = _texts(tmp_path / "rows.jsonl.gz", ["a", "b", ""])
    with pytest.raises(DataError) as excinfo:
        check_rows(load_raw(path), "completion", path)
    one_line(excinfo, f"{path}:3: field 'text' must be a non-empty string")


@pytest.mark.parametrize("damage", [
    lambda packed: b'{"text": "a"}\n',  # not gzip at all
    lambda packed: packed[: len(packed) // 2],  # cut short
    lambda packed: packed[:12] + bytes(255 - b for b in packed[12:-8]) + packed[-8:],  # a damaged body
    lambda packed: bz2.compress(b'{"text": "a"}\n'),  # another compression
], ids=["plain", "cut", "damaged", "bz2"])
def test_a_file_that_is_not_what_its_compression_suffix_says(tmp_path: Path, damage: Any) -> None:
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(damage(gzip.compress(b'{"text": "a"}\n' * 50)))
    with pytest.raises(DataError) as excinfo:
        load_raw(str(path))
    one_line(excinfo, f"{path}: cannot be decompressed as .gz (")


def test_a_file_is_one_split_and_has_no_subsets(tmp_path: Path) -> None:
    path = _texts(tmp_path / "rows.jsonl", ["a", "b", "c", "d"])
    assert load_raw(path, split="train[:50%]")["text"][:] == ["a", "b"]
    with pytest.raises(DataError) as excinfo:
        load_raw(path, split="validation")
    one_line(excinfo, f"{path}: a file is one split, train, not 'validation'")
    with pytest.raises(DataError) as excinfo:
        load_raw(path, subset="en")
    one_line(excinfo, f"{path}: a file has no subsets")
    with pytest.raises(DataError) as excinfo:
        load_raw(path, split="train[10:]")
    one_line(excinfo, f"{path}: split 'train[10:]' picks no rows (of 4 in train); widen the slice")


def test_load_splits_reads_a_folder_split_and_a_slice_with_their_places(tmp_path: Path, tok: Any) -> None:
    """Through the trainer's own entry: the eval split is a folder's validation split, the train split a slice of
    a compressed file; a bad row of either names its file and line."""
    folder = _repo(tmp_path)
    train = _texts(tmp_path / "train.jsonl.gz", ["a", "b", "c", ""])
    bundle = load_splits(DataConfig(format="completion", train=[{"path": train, "split": "train[:3]"}],
                                    eval=[{"path": str(folder), "split": "validation"}]), tok)
    assert bundle.train is not None and len(bundle.train.dataset) == 3
    assert bundle.eval is not None and len(bundle.eval.dataset) == 2
    with pytest.raises(DataError) as excinfo:
        load_splits(DataConfig(format="completion", train=[{"path": train, "split": "train[1:]"}]), tok)
    one_line(excinfo, f"{train}:4: ")
