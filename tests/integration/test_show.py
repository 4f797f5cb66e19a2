"""``finetune preprocess RECIPE --show N``: the first tokenized train rows with the trained tokens marked.

The trained spans are checked against the source rows (each assistant message inside a trained span, no user or
system text in one), the labels against the cached split a run reads, and the text against the tokenizer's own
decode of the stored ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import pytest

from finetune.config import load_recipe
from finetune.data.rows import IGNORE
from finetune.data.show import entries, pieces, trained_spans
from finetune.errors import DataError
from finetune.registry import recipe_row
from finetune.runtime import prepare
from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import DATA, tiny_recipe, write_named

CHATS = [json.loads(line) for line in (DATA / "tiny_chat.jsonl").read_text().splitlines()]


def chat_recipe(folder: Path) -> Path:
    return write_named(folder, "chat", tiny_recipe(data={"format": "chat", "train": str(DATA / "tiny_chat.jsonl"),
                                                         "eval": None, "max_seq_len": 256}))


def stored(recipe: Path) -> prepare.Inputs:
    cfg, _ = load_recipe(str(recipe))
    return prepare.inputs(cfg, recipe_row(cfg))


def inside(span: tuple[int, int], spans: list[list[int]]) -> bool:
    return any(first <= span[0] and span[1] <= last for first, last in spans)


def overlaps(span: tuple[int, int], spans: list[list[int]]) -> bool:
    return any(span[0] < last and first < span[1] for first, last in spans)


def test_json_rows_train_each_answer_and_no_prompt(tmp_path: Path, monkeypatch, capsys) -> None:
    recipe = chat_recipe(tmp_path)
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", str(recipe), "--show", "5", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]  # stdout holds JSON lines only
    assert [row["row"] for row in rows] == list(range(5)) and {row["split"] for row in rows} == {"train"}
    inputs = stored(recipe)
    dataset, tokenizer = inputs.data.train.dataset, inputs.tokenizer
    for row, chat in zip(rows, CHATS, strict=False):
        assert row["labels"] == dataset[row["row"]]["labels"] and row["input_ids"] == dataset[row["row"]]["input_ids"]
        assert row["text"] == tokenizer.decode(row["input_ids"])
        at = 0
        for message in chat["messages"]:  # each message's text, found in order
            start = row["text"].index(message["content"], at)
            at = start + len(message["content"])
            if message["role"] == "assistant":
                assert inside((start, at), row["trained"]), (message, row["trained"])
            else:
                assert not overlaps((start, at), row["trained"]), (message, row["trained"])


def test_piped_output_brackets_each_answer(tmp_path: Path, monkeypatch, capsys) -> None:
    recipe = chat_recipe(tmp_path)
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", str(recipe), "--show", "2")
    assert code == 0, err
    assert out.splitlines()[0].startswith("data.train ") and "\x1b[" not in out
    inputs = stored(recipe)
    tokenizer, dataset = inputs.tokenizer, inputs.data.train.dataset
    shown = out.split("train row 1\n")[1]
    answers = [m["content"] + tokenizer.eos_token for m in CHATS[1]["messages"] if m["role"] == "assistant"]
    assert re.findall(r"\[\[(.*?)\]\]", shown, flags=re.S) == answers
    assert shown.replace("[[", "").replace("]]", "") == tokenizer.decode(dataset[1]["input_ids"]) + "\n"


def test_more_rows_than_the_split_shows_them_all_and_says_so(tmp_path: Path, monkeypatch, capsys) -> None:
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", str(chat_recipe(tmp_path)), "--show", "100")
    assert code == 0, err
    assert out.count("train row ") == len(CHATS)
    assert f"the train split holds only {len(CHATS)} rows" in err


def test_preference_pairs_show_both_sides(tmp_path: Path, monkeypatch, capsys) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join((DATA / "reverse_pref_train.jsonl").read_text().splitlines()[:4]) + "\n")
    recipe = write_named(tmp_path, "dpo", tiny_recipe(task="dpo", data={"format": "preference", "train": str(pairs),
                                                                         "eval": None}))
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", str(recipe), "--show", "2", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(row["row"], row["side"]) for row in rows] == [(0, "chosen"), (0, "rejected"), (1, "chosen"),
                                                          (1, "rejected")]
    source = json.loads(pairs.read_text().splitlines()[0])
    for row in rows[:2]:
        answer = source[row["side"]]
        start = row["text"].rindex(answer)
        assert inside((start, start + len(answer)), row["trained"])
        assert not overlaps((0, len(source["prompt"].rstrip())), row["trained"])


def test_json_without_show_is_a_user_error(tmp_path: Path, monkeypatch, capsys) -> None:
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", str(chat_recipe(tmp_path)), "--json")
    assert_user_error(code, out, err, "--show")


def test_prompt_rows_are_not_shown(tmp_path: Path, monkeypatch, capsys) -> None:
    recipe = write_named(tmp_path, "g", tiny_recipe(
        task="grpo", data={"format": "prompt", "train": str(DATA / "reverse_prompts_train.jsonl"), "eval": None},
        train={"max_steps": 1, "micro_batch_size": 2, "global_batch_size": 2},
        grpo={"group_size": 2, "max_new_tokens": 4, "rewards": [{"exact_match": True}]}))
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", str(recipe), "--show", "1")
    assert code == 2 and "--show covers causal-LM rows" in err and "Traceback" not in err
    assert out.startswith("data.train ")  # the data was preprocessed first


def test_classification_rows_are_not_shown() -> None:
    from datasets import Dataset

    with pytest.raises(DataError, match="classification rows"):
        entries(Dataset.from_dict({"input_ids": [[1, 2]], "label": [0]}), 1)


class SpaceDropping:
    """A tokenizer whose lone tokens lose their leading space (as sentencepiece's do), so per-token decodes do not
    join into the decode of the whole."""

    vocab: ClassVar[dict[int, str]] = {1: "<s>", 2: " a", 3: " b", 4: "c"}

    def decode(self, ids: list[int]) -> str:
        text = "".join(self.vocab[i] for i in ids)
        return text.lstrip(" ") if len(ids) == 1 else text


def test_pieces_join_into_the_whole_decode_when_lone_tokens_do_not() -> None:
    tokenizer = SpaceDropping()
    ids = [1, 2, 3, 4]
    assert "".join(tokenizer.decode([i]) for i in ids) != tokenizer.decode(ids)
    assert pieces(tokenizer, ids) == ["<s>", " a", " b", "c"]
    assert "".join(pieces(tokenizer, ids)) == tokenizer.decode(ids)


def test_trained_spans_are_maximal_runs_of_labelled_text() -> None:
    texts = ["ab", "c", "", "de", "f"]
    labels = [IGNORE, 5, 6, 7, IGNORE]
    # "ab" untrained, then "c" + "" + "de" trained: characters 2..5 of "abcdef"
    assert trained_spans(texts, labels) == [[2, 5]]
    assert trained_spans(["x", "y", "z"], [1, IGNORE, 2]) == [[0, 1], [2, 3]]


def _trl_template(name: str) -> Path:
    """The original chat template ``name`` the installed trl ships (read where it is, never copied)."""
    trl = pytest.importorskip("trl")
    return Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"


def templated_recipe(folder: Path, template: Path, **model: object) -> Path:
    folder.mkdir(exist_ok=True)
    return write_named(folder, "chat", tiny_recipe(
        model={"chat_template": str(template), **model},
        data={"format": "chat", "train": str(DATA / "tiny_chat.jsonl"), "eval": None, "max_seq_len": 256}))


def test_a_last_turn_rendered_differently_is_one_sample_per_turn(tmp_path: Path, monkeypatch, capsys) -> None:
    """Qwen3's template writes an empty think block in the last assistant turn only: a two-turn conversation
    (the file's second row) becomes two samples, each the conversation up to its turn with that turn trained as
    the template renders a last turn: ``<think>\\n\\n</think>\\n\\n``, the answer, ``<|im_end|>``."""
    recipe = templated_recipe(tmp_path, _trl_template("qwen3"))
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", str(recipe), "--show", "3", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert "samples, tokenized now" in err and "warning" not in err
    first, second = [m["content"] for m in CHATS[1]["messages"] if m["role"] == "assistant"]
    turn = "<think>\n\n</think>\n\n{}<|im_end|>".format
    assert [[row["text"][a:b] for a, b in row["trained"]] for row in rows[1:3]] == [[turn(first)], [turn(second)]]
    assert rows[2]["text"].startswith(rows[1]["text"][:rows[1]["trained"][0][0]])  # the same conversation
    assert first in rows[2]["text"] and f"{first}<|im_end|>" in rows[2]["text"]  # earlier turn: context, as rendered


def test_a_prefilled_think_is_one_warning_and_template_arguments_remove_it(tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    recipe = templated_recipe(tmp_path / "a", _trl_template("nemotron_3_nano"))
    code, _, err = main_exit(monkeypatch, capsys, "preprocess", str(recipe))
    assert code == 0, err
    [warning] = [line for line in err.splitlines() if line.startswith("warning:")]
    assert "generation prompt ends with '\\n'" in warning and "model.chat_template_kwargs" in warning
    recipe = templated_recipe(tmp_path / "b", _trl_template("nemotron_3_nano"),
                              chat_template_kwargs={"enable_thinking": False})
    code, out, err = main_exit(monkeypatch, capsys, "preprocess", str(recipe), "--show", "1", "--json")
    assert code == 0, err
    assert "warning" not in err
    [row] = [json.loads(line) for line in out.splitlines()]
    [(start, end)] = row["trained"]
    assert row["text"][:start].endswith("<|im_start|>assistant\n<think></think>")
    assert row["text"][start:end] == CHATS[0]["messages"][-1]["content"] + "<|im_end|>"
