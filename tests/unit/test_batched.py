"""Tokenizing in batches and in several processes (finetune/data/batched.py) gives what one row at a time gave.

The batched tokenizer call must give each text the ids and offsets of a plain per-text call, labels must mark the
same tokens, and ``data.num_proc`` must change nothing in the tokenized split nor in which bad row is reported.
(A data file rewritten with its old modification time is test_sources.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pytest

from finetune.data import batched, loading
from finetune.data.formats import Rendered
from finetune.data.loading import load_raw
from finetune.data.rows import IGNORE
from finetune.data.tokenize import tokenize_rows
from finetune.errors import DataError
from tests.data_files import write_rows

TEXTS = ["", " ", "plain words here", "<|user|>\nhi\n<|assistant|>\nyo</s>\n", "naïve café ☕ — 日本語 🙂🙂",
         "tabs\tand\r\nnewlines\n\n", "<s>starts with bos", "x" * 300, "</s></s><pad>odd specials<unk>"]


def _chat(i: int, bad: bool = False) -> dict[str, Any]:
    user = {"role": "user", "content": f"question {i} " + "a b " * (i % 5)}
    answer = {"role": "robot" if bad else "assistant", "content": f"answer {i}"}
    return {"messages": [user, answer]}


def test_one_batched_call_gives_each_text_what_a_call_per_text_gives(tok: Any) -> None:
    encoded = batched.encode_texts(TEXTS, tok)
    ids = batched.token_ids(TEXTS, tok)
    for text, (got_ids, got_offsets), got_plain in zip(TEXTS, encoded, ids, strict=True):
        one = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert list(got_ids) == one["input_ids"] == got_plain
        assert [tuple(o) for o in got_offsets] == [tuple(o) for o in one["offset_mapping"]]


def test_labels_mark_every_token_that_overlaps_an_answer_span(tok: Any) -> None:
    text = "<|user|>\nab cd\n<|assistant|>\nef gh</s>\nij"
    spans = ((text.index("ef"), text.index("</s>") + 4), (len(text) - 1, len(text)))
    one = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    expected = [tid if any(s < e_span and e > s_span for s_span, e_span in spans) else IGNORE
                for tid, (s, e) in zip(one["input_ids"], one["offset_mapping"], strict=True)]
    assert batched.answer_labels(one["input_ids"], one["offset_mapping"], spans) == expected
    assert IGNORE in expected and any(label != IGNORE for label in expected)
    [(ids, labels)] = batched.samples([Rendered(text, spans, "", "", add_eos=True)], tok, "auto")  # raw text
    assert ids == [tok.bos_token_id, *one["input_ids"], tok.eos_token_id]
    assert labels == [IGNORE, *expected, tok.eos_token_id]


def test_a_tokenizer_left_truncating_is_called_through_transformers(tok: Any) -> None:
    """transformers turns a backend's truncation off for a call without truncation; calling the backend directly
    would have cut the text."""
    tok.backend_tokenizer.enable_truncation(3)
    try:
        assert batched._backend(tok) is None
        assert batched.token_ids(["a b c d e f"], tok) == [tok("a b c d e f", add_special_tokens=False)["input_ids"]]
        assert len(batched.token_ids(["a b c d e f"], tok)[0]) > 3
    finally:
        tok.backend_tokenizer.no_truncation()
    assert batched._backend(tok) is not None


def test_num_proc_changes_nothing_in_the_tokenized_split(tmp_path: Path, tok: Any) -> None:
    source = write_rows(tmp_path / "chat.jsonl", [_chat(i) for i in range(40)])
    raw = load_raw(source)
    one = tokenize_rows(raw, fmt="chat", tokenizer=tok, max_len=24, overlong="truncate", add_bos="auto",
                        source=source, num_proc=1)
    two = tokenize_rows(raw, fmt="chat", tokenizer=tok, max_len=24, overlong="truncate", add_bos="auto",
                        source=source, num_proc=2)
    assert one.truncated == two.truncated > 0
    assert one.dataset.to_dict() == two.dataset.to_dict()
    assert one.dataset._fingerprint == two.dataset._fingerprint  # one cache key: either count reuses the other's


def test_several_processes_report_the_first_bad_row(tmp_path: Path, tok: Any) -> None:
    """The second worker's shard (rows 21-40) starts with a bad row, the first shard has one near its end: one
    process reports line 19, and so must two."""
    rows = [_chat(i, bad=i in (18, 20)) for i in range(40)]
    source = write_rows(tmp_path / "bad.jsonl", rows)
    raw = load_raw(source)
    with pytest.raises(DataError) as one:
        tokenize_rows(raw, fmt="chat", tokenizer=tok, max_len=64, overlong="truncate", add_bos="auto", source=source,
                      num_proc=1)
    with pytest.raises(DataError) as two:
        tokenize_rows(raw, fmt="chat", tokenizer=tok, max_len=64, overlong="truncate", add_bos="auto", source=source,
                      num_proc=2)
    assert str(one.value).startswith(f"{source}:19: ")
    assert str(two.value) == str(one.value)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_parquet_and_arrow_rows_load_and_a_bad_row_is_one_line(tmp_path: Path, tok: Any, kind: str) -> None:
    rows = [_chat(i) for i in range(5)]
    rows[3] = {"messages": [{"role": "user", "content": "hi"}]}  # no assistant turn
    table = datasets.Dataset.from_list(rows)
    path = str(tmp_path / f"train.{kind}")
    if kind == "parquet":
        table.to_parquet(path)
    else:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.data.schema) as writer:
            writer.write_table(table.data.table)
    raw = load_raw(path)
    assert len(raw) == 5 and raw[0]["messages"] == rows[0]["messages"]
    with pytest.raises(DataError, match=rf"^{path} \(row 4\): the last message must be the assistant's"):
        tokenize_rows(raw, fmt="chat", tokenizer=tok, max_len=64, overlong="truncate", add_bos="auto", source=path)


def test_a_corrupt_arrow_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.arrow"
    path.write_bytes(b"not arrow at all\n")
    with pytest.raises(DataError, match=rf"^{path}: cannot be read as arrow \(") as error:
        load_raw(str(path))
    assert "\n" not in str(error.value)


# forks a worker inside workers_die_with_this_process; the worker reports whether it ignores Ctrl+C, then sleeps
FORKING_PARENT = """
import os, signal, sys, time
from finetune.data import batched
with batched.workers_die_with_this_process():
    if os.fork() == 0:
        print(os.getpid(), signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
        time.sleep(120)
        os._exit(0)
    time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_tokenizing_worker_dies_with_the_process_that_forked_it(tmp_path: Path) -> None:
    """A worker whose parent is SIGKILLed goes at once (it went on tokenizing for nobody); it leaves Ctrl+C to
    its parent, which stops the pool and says one line."""
    parent = subprocess.Popen([sys.executable, "-c", FORKING_PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert parent.stdout is not None
    worker, ignores_ctrl_c = parent.stdout.readline().split()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(worker)
    if alive:
        os.kill(int(worker), signal.SIGKILL)
    assert not alive and ignores_ctrl_c == "True"


def _running(pid: str) -> bool:
    """Whether process ``pid`` runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_default_process_count_follows_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(32)))
    assert batched.processes(None, 40) == 1  # a small file: no pool
    assert batched.processes(None, 3 * batched.MIN_ROWS_PER_PROCESS) == 3
    assert batched.processes(None, 10**7) == batched.MAX_DEFAULT_PROCESSES
    assert batched.processes(2, 40) == 2 and batched.processes(64, 5) == 5  # as set, at most one per row


@pytest.mark.parametrize("text", ["{}\n\n{}\n", "{}\n  \t\n{}\n", "{}\n{}\n \n"])
def test_a_blank_line_across_two_reads_of_the_file_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            text: str) -> None:
    """The blank-line scan reads the file in chunks (its memory does not grow with the file); a blank line that
    starts in one chunk and ends in the next is still reported with its line."""
    monkeypatch.setattr(loading, "CHUNK", 3)
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"^{path}:[23]: empty line"):
        loading.load_raw(str(path))
