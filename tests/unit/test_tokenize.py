"""finetune.data.tokenize: answer masking per format, labels, the over-long policy, and the cached tokenized splits.
Row checks and file loading are test_loading.py; rendering a row, test_formats.py.

Everything runs on the bundled tiny tokenizer (byte-level BPE, ``<s>``=1, ``</s>``=2, ``<pad>``=0) and on small
files written to ``tmp_path`` or the bundled ``recipes/data`` files; no model is built.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from finetune.config.schema import DataConfig
from finetune.data import load_splits
from finetune.data.loading import check_rows, load_raw
from finetune.data.tokenize import IGNORE, label_names, tokenize_rows
from finetune.errors import DataError
from tests.data_files import CHAT_TWO_TURNS, write_jsonl, write_rows

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "recipes" / "data"
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"

ALPACA_WITH_INPUT = {"instruction": "Reverse the letters.", "input": "d a c z", "output": "z c a d"}
ALPACA_NO_INPUT = {"instruction": "Say hello.", "input": "", "output": "hello there"}


def _tokenize_list(rows: list[dict], tok: Any, fmt: str = "alpaca", max_len: int = 512, overlong: str = "truncate",
                  train_on_prompt: bool = False) -> Any:
    return tokenize_rows(datasets.Dataset.from_list(rows), fmt=fmt, tokenizer=tok, max_len=max_len, overlong=overlong,
                         add_bos="auto", train_on_prompt=train_on_prompt, source="test")


def trained_runs(tok: Any, ids: list[int], labels: list[int]) -> list[str]:
    """Decoded text of each maximal run of trained (label != -100) tokens."""
    runs: list[list[int]] = []
    previous = False
    for tid, label in zip(ids, labels, strict=True):
        trained = label != IGNORE
        if trained:
            assert label == tid, "a trained label must be the token itself"
            if not previous:
                runs.append([])
            runs[-1].append(tid)
        previous = trained
    return [tok.decode(run) for run in runs]


def masked_text(tok: Any, ids: list[int], labels: list[int]) -> str:
    return tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab == IGNORE])


# ----------------------------------------------------------------------------------------------- alpaca rendering


def test_alpaca_with_input_masks_prompt_and_trains_answer_and_eos(tok: Any) -> None:
    row = _tokenize_list([ALPACA_WITH_INPUT], tok).dataset[0]
    prompt = "### Instruction:\nReverse the letters.\n\n### Input:\nd a c z\n\n### Response:\n"
    ids, labels = row["input_ids"], row["labels"]
    assert tok.decode(ids) == "<s>" + prompt + "z c a d</s>"
    assert ids[0] == tok.bos_token_id and labels[0] == IGNORE
    assert ids[-1] == tok.eos_token_id and labels[-1] == tok.eos_token_id
    assert trained_runs(tok, ids, labels) == ["z c a d</s>"]
    assert masked_text(tok, ids, labels) == "<s>" + prompt
    # the trained tokens are exactly how the answer tokenizes on its own (what the model generates), plus eos
    answer_ids = tok("z c a d", add_special_tokens=False)["input_ids"]
    assert [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE] == [*answer_ids, tok.eos_token_id]
    # generation prompt: <s> + prompt, a prefix of the training ids; the reference is the output
    assert tok.decode(row["prompt_ids"]) == "<s>" + prompt
    assert ids[: len(row["prompt_ids"])] == row["prompt_ids"]
    assert row["reference"] == "z c a d"


def test_alpaca_without_input_uses_the_short_template(tok: Any) -> None:
    for row in (ALPACA_NO_INPUT, {"instruction": "Say hello.", "output": "hello there"}):
        out = _tokenize_list([row], tok).dataset[0]
        prompt = "### Instruction:\nSay hello.\n\n### Response:\n"
        assert "### Input" not in tok.decode(out["input_ids"])
        assert masked_text(tok, out["input_ids"], out["labels"]) == "<s>" + prompt
        assert trained_runs(tok, out["input_ids"], out["labels"]) == ["hello there</s>"]


def test_train_on_prompt_trains_everything_but_bos(tok: Any) -> None:
    row = _tokenize_list([ALPACA_WITH_INPUT], tok, train_on_prompt=True).dataset[0]
    ids, labels = row["input_ids"], row["labels"]
    assert labels[0] == IGNORE and ids[0] == tok.bos_token_id
    assert labels[1:] == ids[1:]
    assert ids[-1] == tok.eos_token_id
    assert row["reference"] == "z c a d"  # generation still compares with the answer only


def test_answer_right_after_newline_first_token_trained(tok: Any) -> None:
    # the last prompt character is "\n"; the answer's first token must be trained and the "\n" must not
    for answer in ("zebra", "z", "Zq x", "1 2 3", "  spaced"):
        row = _tokenize_list([{"instruction": "Go.", "output": answer}], tok).dataset[0]
        ids, labels = row["input_ids"], row["labels"]
        first = next(i for i, lab in enumerate(labels) if lab != IGNORE)
        assert tok.decode(ids[first - 1]) == "\n" and labels[first - 1] == IGNORE
        assert tok.decode(ids[first:]) == answer + "</s>"
        assert all(lab != IGNORE for lab in labels[first:])


# -------------------------------------------------------------------------------------------------- chat format


def test_chat_two_turns_trains_only_assistant_content_and_eos(tok: Any) -> None:
    row = _tokenize_list([CHAT_TWO_TURNS], tok, fmt="chat").dataset[0]
    ids, labels = row["input_ids"], row["labels"]
    # the tokens apply_chat_template(tokenize=True) gives, as every server tokenizes the chat (no bos: the template
    # writes none)
    assert ids == tok.apply_chat_template(CHAT_TWO_TURNS["messages"], tokenize=True, return_dict=False)
    assert tok.decode(ids) == ("<|system|>\nBe brief.\n<|user|>\nFirst letter of: d r z?\n<|assistant|>\nd</s>\n"
                               "<|user|>\nFirst letter of: f b v?\n<|assistant|>\nf</s>\n")
    assert trained_runs(tok, ids, labels) == ["d</s>", "f</s>"]
    masked = masked_text(tok, ids, labels)
    assert masked == ("<|system|>\nBe brief.\n<|user|>\nFirst letter of: d r z?\n<|assistant|>\n\n"
                      "<|user|>\nFirst letter of: f b v?\n<|assistant|>\n\n")
    special = {tok.convert_tokens_to_ids(t): t for t in ("<|system|>", "<|user|>", "<|assistant|>")}
    assert all(lab == IGNORE for t, lab in zip(ids, labels, strict=True) if t in special)
    # generation: the conversation up to the last assistant turn + the generation prompt; reference = last content
    prompt = tok.decode(row["prompt_ids"])
    assert prompt == ("<|system|>\nBe brief.\n<|user|>\nFirst letter of: d r z?\n<|assistant|>\nd</s>\n"
                      "<|user|>\nFirst letter of: f b v?\n<|assistant|>\n")
    assert row["prompt_ids"] == tok.apply_chat_template(CHAT_TWO_TURNS["messages"][:-1], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
    assert ids[: len(row["prompt_ids"])] == row["prompt_ids"]
    assert row["reference"] == "f"


def test_bundled_chat_file_trains_every_assistant_turn(tok: Any) -> None:
    source = str(DATA / "tiny_chat.jsonl")
    raw = load_raw(source)
    check_rows(raw, "chat", source)
    result = tokenize_rows(raw, fmt="chat", tokenizer=tok, max_len=512, overlong="truncate", add_bos="auto",
                           source=source)
    assert len(result.dataset) == len(raw) and result.truncated == result.dropped == result.no_answer == 0
    for messages, row in zip(raw["messages"], result.dataset, strict=True):
        expected = [m["content"] + "</s>" for m in messages if m["role"] == "assistant"]
        assert trained_runs(tok, row["input_ids"], row["labels"]) == expected
        assert row["reference"] == messages[-1]["content"]


# -------------------------------------------------------------------------------------------------- completion


def test_completion_trains_everything(tok: Any) -> None:
    text = "A young girl waited for a while."
    row = _tokenize_list([{"text": text}], tok, fmt="completion").dataset[0]
    ids, labels = row["input_ids"], row["labels"]
    assert tok.decode(ids) == "<s>" + text + "</s>"
    assert labels[0] == IGNORE and labels[1:] == ids[1:]
    assert row["prompt_ids"] == [tok.bos_token_id] and row["reference"] == text


def test_classification_label_not_in_configured_labels(tmp_path: Path) -> None:
    rows = [{"text": "a", "label": "pos"}, {"text": "b", "label": "neutral"}]
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(DataError, match=r"label 'neutral' is not in data\.labels"):
        label_names(load_raw(path), ["neg", "pos"], path)


def test_eval_label_unknown_to_train_is_an_error(tmp_path: Path, tok: Any) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", [json.dumps({"text": "a", "label": x}) for x in ("x", "y")])
    evals = write_jsonl(tmp_path / "e.jsonl", [json.dumps({"text": "a", "label": x}) for x in ("x", "z")])
    with pytest.raises(DataError, match=rf"{evals}:2: label 'z' is not one of \['x', 'y'\]"):
        load_splits(DataConfig(format="classification", train=train, eval=evals), tok)


# ------------------------------------------------------------------------------------------------------ labels


def test_string_labels_sorted(tok: Any) -> None:
    source = str(DATA / "topics_train.jsonl")
    raw = load_raw(source)
    names = label_names(raw, None, source)
    assert names == ["food", "sports", "technology", "weather"]
    out = tokenize_rows(raw.select(range(20)), fmt="classification", tokenizer=tok, max_len=64, overlong="truncate",
                        add_bos="auto", labels=names, source=source)
    assert [names[i] for i in out.dataset["label"]] == raw.select(range(20))["label"]


def test_integer_labels_from_csv(tok: Any) -> None:
    source = str(DATA / "tiny_classification.csv")
    bundle = load_splits(DataConfig(format="classification", train=source), tok)
    assert bundle.labels == ["0", "1", "2"]
    raw = load_raw(source)
    assert bundle.train is not None
    assert bundle.train.dataset["label"] == raw["label"]
    first = bundle.train.dataset[0]
    assert first["input_ids"][0] == tok.bos_token_id  # classification keeps the tokenizer's special tokens
    assert tok.decode(first["input_ids"], skip_special_tokens=True) == raw[0]["text"]


def test_configured_labels_are_honoured(tmp_path: Path, tok: Any) -> None:
    rows = [{"text": "a", "label": "pos"}, {"text": "b", "label": "neg"}, {"text": "c", "label": "pos"}]
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    bundle = load_splits(DataConfig(format="classification", train=path, labels=["pos", "neg"]), tok)
    assert bundle.labels == ["pos", "neg"]
    assert bundle.train is not None and bundle.train.dataset["label"] == [0, 1, 0]
    # integer ids in the data index the configured names
    source = str(DATA / "tiny_classification.csv")
    bundle = load_splits(DataConfig(format="classification", train=source, labels=["sports", "food", "weather"]),
                         tok)
    assert bundle.labels == ["sports", "food", "weather"]
    assert bundle.train is not None and bundle.train.dataset["label"] == load_raw(source)["label"]


def test_mixed_int_and_str_labels_are_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "a", "label": x}) for x in ("pos", 1, "neg")])
    with pytest.raises(DataError, match="mix integer ids and names"):
        label_names(load_raw(path), None, path)
    with pytest.raises(DataError, match="mix integer ids and names"):
        label_names({"label": [0, "pos"]}, None, "mem")


# ------------------------------------------------------------------------------------------------- over-long rows

LONG = {"text": " ".join(["word"] * 40)}
SHORT = {"text": "short one"}


def test_overlong_truncate_keeps_rows_and_counts(tok: Any) -> None:
    out = _tokenize_list([SHORT, LONG, SHORT, LONG, LONG], tok, fmt="completion", max_len=8)
    assert len(out.dataset) == 5
    assert (out.truncated, out.dropped, out.no_answer) == (3, 0, 0)
    assert max(len(ids) for ids in out.dataset["input_ids"]) == 8
    assert all(len(ids) == len(labels) for ids, labels in zip(out.dataset["input_ids"], out.dataset["labels"],
                                                              strict=True))


def test_overlong_drop_removes_rows_and_counts(tok: Any) -> None:
    out = _tokenize_list([SHORT, LONG, SHORT, LONG, LONG], tok, fmt="completion", max_len=8, overlong="drop")
    assert len(out.dataset) == 2
    assert (out.truncated, out.dropped, out.no_answer) == (0, 3, 0)
    assert [tok.decode(ids) for ids in out.dataset["input_ids"]] == ["<s>short one</s>"] * 2


def test_truncation_that_cuts_the_whole_answer_is_skipped(tok: Any) -> None:
    short = {"instruction": "Go.", "output": "ok"}
    long_prompt = {"instruction": "Go " * 30, "output": "ok"}
    max_len = len(_tokenize_list([short], tok).dataset[0]["input_ids"])
    out = _tokenize_list([short, long_prompt, short], tok, max_len=max_len)
    assert len(out.dataset) == 2 and (out.truncated, out.dropped, out.no_answer) == (1, 0, 1)
    # a truncated sample that keeps part of its answer stays, with only that part trained
    prompt_len = len(_tokenize_list([short], tok).dataset[0]["prompt_ids"])
    partial = _tokenize_list([{"instruction": "Go.", "output": "a b c d e f g h"}], tok, max_len=prompt_len + 3)
    assert partial.truncated == 1 and len(partial.dataset) == 1
    assert trained_runs(tok, partial.dataset[0]["input_ids"], partial.dataset[0]["labels"]) == ["a b c"]
    dropped = _tokenize_list([short, long_prompt, short], tok, max_len=max_len, overlong="drop")
    assert len(dropped.dataset) == 2 and (dropped.truncated, dropped.dropped, dropped.no_answer) == (0, 1, 0)
    with pytest.raises(DataError, match="no usable samples"):
        _tokenize_list([long_prompt], tok, max_len=max_len)


# ------------------------------------------------------------------------------------------------ file formats

ROWS = [{"instruction": "Reverse the letters.", "input": "a b", "output": "b a"},
        {"instruction": "Say, \"hi\".", "input": "", "output": "hi"}]


def test_load_raw_reads_jsonl_json_csv_parquet(tmp_path: Path) -> None:
    paths = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in ROWS]),
        "json": str(tmp_path / "d.json"),
        "csv": str(tmp_path / "d.csv"),
        "parquet": str(tmp_path / "d.parquet"),
    }
    Path(paths["json"]).write_text(json.dumps(ROWS))
    with open(paths["csv"], "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    datasets.Dataset.from_list(ROWS).to_parquet(paths["parquet"])
    for kind, path in paths.items():
        raw = load_raw(path)
        check_rows(raw, "alpaca", path)
        got = [{k: (row[k] or "") for k in ROWS[0]} for row in raw]  # csv reads an empty field as None
        assert got == ROWS, kind


def test_load_splits_eval_ignores_train_on_prompt(tmp_path: Path, tok: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in ROWS])
    bundle = load_splits(DataConfig(format="alpaca", train=path, eval=path, train_on_prompt=True), tok)
    assert bundle.labels is None and bundle.train is not None and bundle.eval is not None
    train, evaluation = bundle.train.dataset[0], bundle.eval.dataset[0]
    assert train["input_ids"] == evaluation["input_ids"]
    assert train["labels"][1:] == train["input_ids"][1:]
    assert trained_runs(tok, evaluation["input_ids"], evaluation["labels"]) == ["b a</s>"]
    only_eval = load_splits(DataConfig(format="alpaca", train=path, eval=path), tok, need_train=False)
    assert only_eval.train is None and only_eval.eval is not None


def test_tokenize_cache_is_keyed_by_the_code(tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run reuses the map cache, but a change to rendering/masking code must not (stale labels)."""
    import finetune.data.tokenize as tokenize_module
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in ROWS])

    def cache_files() -> set[str]:
        out = tokenize_rows(load_raw(path), fmt="alpaca", tokenizer=tok, max_len=64, overlong="truncate",
                            add_bos="auto", source=path)
        return {f["filename"] for f in out.dataset.cache_files}

    first = cache_files()
    assert first and cache_files() == first
    monkeypatch.setattr(tokenize_module, "CODE_VERSION", "edited")
    assert cache_files().isdisjoint(first)


def test_load_splits_reports_a_bad_row_by_line_through_the_cached_map(tmp_path: Path, tok: Any) -> None:
    """The row checks run inside the tokenization map (once per data version), still naming file:line."""
    from finetune.config.schema import DataConfig
    from finetune.data import load_splits

    good = {"instruction": "Go.", "output": "a b"}
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(good), json.dumps(good), json.dumps({"instruction": "x"})])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: missing field 'output'"):
        load_splits(DataConfig(format="alpaca", train=path), tok)
    blank = write_jsonl(tmp_path / "blank.jsonl", [json.dumps(good), "", json.dumps(good)])
    with pytest.raises(DataError, match=r"blank\.jsonl:2: empty line"):
        load_splits(DataConfig(format="alpaca", train=blank), tok)


# ------------------------------------------------------------------------------------ ShareGPT rows, chat templates

SHAREGPT_ROWS = [
    {"conversations": [{"from": "human", "value": "First letter of: d r z?"}, {"from": "gpt", "value": "d"}]},
    {"system": "Be brief.", "conversations": [
        {"from": "human", "value": "First letter of: f b v?"}, {"from": "gpt", "value": "f"},
        {"from": "human", "value": "And of: q a?"}, {"from": "chatgpt", "value": "q"}]},
    {"system": "", "conversations": [{"from": "system", "value": "Answer in one word."},
                                     {"from": "user", "value": "Sky colour?"}, {"from": "assistant", "value": "blue"}]},
]
SAME_AS_MESSAGES = [  # the rows above written as messages, by hand
    {"messages": [{"role": "user", "content": "First letter of: d r z?"}, {"role": "assistant", "content": "d"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "First letter of: f b v?"},
                  {"role": "assistant", "content": "f"}, {"role": "user", "content": "And of: q a?"},
                  {"role": "assistant", "content": "q"}]},
    {"messages": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"},
                  {"role": "assistant", "content": "blue"}]},
]
TOOL_ROW = {"conversations": [{"from": "human", "value": "Weather?"},
                              {"from": "function_call", "value": "{\"name\": \"weather\", \"arguments\": {}}"},
                              {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}]}
TOOL_AS_MESSAGES = {"messages": [{"role": "user", "content": "Weather?"},
                                 {"role": "assistant", "content": None, "tool_calls": [
                                     {"type": "function", "function": {"name": "weather", "arguments": {}}}]},
                                 {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
# chatml that writes a call as <tool_call>JSON</tool_call> (what the function_call row needs a template to render)
CHATML_TOOLS = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.tool_calls %}{%- for c in "
                "m.tool_calls %}{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{%- endfor %}{%- else %}"
                "{{- m.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TOKEN_COLUMNS = ("input_ids", "labels", "prompt_ids", "reference")


def _chatml(folder: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = CHATML_TOOLS
    return tokenizer


def _tokenized(path: str, tokenizer: Any, **kwargs: Any) -> Any:
    return tokenize_rows(load_raw(path), fmt="chat", tokenizer=tokenizer, max_len=512, overlong="truncate",
                         add_bos="auto", source=path, **kwargs)


def _columns(result: Any) -> dict[str, list]:
    return {name: result.dataset[name] for name in TOKEN_COLUMNS}


@pytest.mark.parametrize("template", ["own", "chatml"])
def test_sharegpt_rows_tokenize_as_the_same_rows_written_as_messages(tmp_path: Path, tok: Any, bare_tokenizer: Path,
                                                                     template: str) -> None:
    """Ids, labels (the masks), generation prompts and references of a ShareGPT file equal those of the same rows
    written as messages, with the tokenizer's own template and with chatml that renders tool calls; a file
    mixing both shapes row by row gives the same again."""
    tokenizer = tok if template == "own" else _chatml(bare_tokenizer)
    rows = SHAREGPT_ROWS + ([TOOL_ROW] if template == "chatml" else [])
    messages = SAME_AS_MESSAGES + ([TOOL_AS_MESSAGES] if template == "chatml" else [])
    sharegpt = _tokenized(write_rows(tmp_path / "sharegpt.jsonl", rows), tokenizer)
    plain = _tokenized(write_rows(tmp_path / "messages.jsonl", messages), tokenizer)
    assert len(plain.dataset) == len(rows) and _columns(sharegpt) == _columns(plain)
    assert [r for r in sharegpt.dataset["labels"]] and any(x != IGNORE for x in sharegpt.dataset["labels"][0])
    mixed = [row if i % 2 else message for i, (row, message) in enumerate(zip(rows, messages, strict=True))]
    assert _columns(_tokenized(write_rows(tmp_path / "mixed.jsonl", mixed), tokenizer)) == _columns(plain)


def test_sharegpt_rows_load_as_a_split_and_stream_alike(tmp_path: Path, tok: Any) -> None:
    """Through load_splits (the column check takes conversations for messages) and through a stream's batch
    function: the same samples as the rows written as messages."""
    from finetune.data.streaming import row_function, tokenize_chunk

    path = write_rows(tmp_path / "sharegpt.json", SHAREGPT_ROWS)  # a JSON list, as ShareGPT dumps are
    split = load_splits(DataConfig(format="chat", train=path, eval=path), tok)
    plain = _tokenized(write_rows(tmp_path / "messages.jsonl", SAME_AS_MESSAGES), tok)
    assert split.train is not None and split.eval is not None
    assert _columns(split.train) == _columns(split.eval) == _columns(plain)
    cfg = DataConfig(format="chat", train=path, max_seq_len=512)
    fn, kwargs = row_function("chat", cfg, tok, None, None)
    streamed = tokenize_chunk(list(enumerate(SHAREGPT_ROWS)), fn, kwargs, source=path, overlong="truncate")
    assert [[sample[name] for name in TOKEN_COLUMNS] for sample in streamed] == \
        [list(values) for values in zip(*_columns(plain).values(), strict=True)]


def test_a_bad_sharegpt_row_names_its_line_through_the_cached_map(tmp_path: Path, tok: Any) -> None:
    bad = {"conversations": [{"from": "human", "value": "a"}, {"from": "narrator", "value": "b"}]}
    path = write_rows(tmp_path / "bad.jsonl", [*SHAREGPT_ROWS, bad])
    with pytest.raises(DataError, match=r"bad\.jsonl:4: conversations\[1\]\.from 'narrator' is not a known ShareGPT "
                                        r"speaker; use one of system, human"):
        load_splits(DataConfig(format="chat", train=path), tok)
    last_user = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}
    path = write_rows(tmp_path / "ends.jsonl", [last_user])
    with pytest.raises(DataError, match=r"ends\.jsonl:1: the last message must be the assistant's"):
        load_splits(DataConfig(format="chat", train=path), tok)
    neither = write_rows(tmp_path / "neither.jsonl", [{"text": "hi"}])
    with pytest.raises(DataError, match=r"neither\.jsonl:1: missing field 'messages' \(or sharegpt 'conversations', "
                                        r"or conversational prompt-completion 'completion'\)"):
        load_splits(DataConfig(format="chat", train=neither), tok)


def test_the_tokenized_cache_is_keyed_by_the_sharegpt_rule_and_the_chat_template(
        tmp_path: Path, bare_tokenizer: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached tokenization of a ShareGPT file is read again only under the same rule and the same template: a
    changed role table or another chat template (model.chat_template) tokenizes the file again."""
    from finetune.data import shapes

    path = write_rows(tmp_path / "sharegpt.jsonl", SHAREGPT_ROWS)
    chatml = _chatml(bare_tokenizer)
    first = _tokenized(path, chatml)
    again = _tokenized(path, chatml)
    assert not first.cached and again.cached and _columns(again) == _columns(first)
    other = _chatml(bare_tokenizer)
    other.chat_template = other.chat_template.replace("<|im_end|>", "<|end|>")
    assert not _tokenized(path, other).cached
    monkeypatch.setitem(shapes.SHAREGPT_ROLES, "chatgpt", "user")  # the same file under another rule
    with pytest.raises(DataError, match=r"sharegpt\.jsonl:2: the last message must be the assistant's"):
        _tokenized(path, chatml)  # not the cache of the old rule: this rule makes row 2 end with a user turn
