"""The preference data contract (data.format: preference) and its recipe checks.

Tokenized pairs have exactly the columns chosen_input_ids / chosen_labels / rejected_input_ids / rejected_labels,
with the prompt masked (IGNORE) and the answers (plus eos) as labels; chat-form pairs train only their final
assistant turn; over-long pairs follow data.overlong; bad rows fail with file:line; PreferenceCollator makes one
batch of 2B rows (chosen first); task dpo / reward and data.format preference go together (one line each).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch

from finetune.config import load_recipe
from finetune.data.batching import PreferenceCollator
from finetune.data.loading import load_raw
from finetune.data.tokenize import IGNORE, tokenize_rows
from finetune.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"
PROMPT = "### Instruction:\nReverse the letters.\n\n### Input:\nd a c z\n\n### Response:\n"
PAIR = {"prompt": PROMPT, "chosen": "z c a d", "rejected": "d a c z"}
CONTRACT = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]


def _tokenize(rows: list[dict], tok: Any, max_len: int = 128, overlong: str = "truncate", source: str = ""):
    return tokenize_rows(datasets.Dataset.from_list(rows), fmt="preference", tokenizer=tok, max_len=max_len,
                         overlong=overlong, add_bos="auto", source=source)


def _answer_ids(labels: list[int]) -> list[int]:
    return [label for label in labels if label != IGNORE]


def test_string_pairs_have_the_contract_columns_and_mask_the_prompt(tok: Any) -> None:
    out = _tokenize([PAIR], tok)
    assert out.dataset.column_names == CONTRACT
    row = out.dataset[0]
    prompt_len = len(tok(PROMPT, add_special_tokens=False)["input_ids"]) + 1  # + bos
    for side in ("chosen", "rejected"):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        assert len(ids) == len(labels)
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        assert labels[:prompt_len] == [IGNORE] * prompt_len  # the whole prompt is masked
        answer = _answer_ids(labels)
        assert answer == ids[prompt_len:]  # every answer token (and eos) is trained, nothing else
        assert tok.decode(answer, skip_special_tokens=True).strip() == PAIR[side]
    assert row["chosen_input_ids"][:prompt_len] == row["rejected_input_ids"][:prompt_len]  # one prompt for both
    assert _answer_ids(row["chosen_labels"]) != _answer_ids(row["rejected_labels"])


def test_chat_pairs_train_only_the_final_assistant_turn(tok: Any) -> None:
    shared = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Repeat: hello"},
              {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Reverse: a b c"}]
    pair = {"chosen": [*shared, {"role": "assistant", "content": "c b a"}],
            "rejected": [*shared, {"role": "assistant", "content": "a b c"}]}
    row = _tokenize([pair], tok).dataset[0]
    for side, answer in (("chosen", "c b a"), ("rejected", "a b c")):
        trained = _answer_ids(row[f"{side}_labels"])
        # the final turn's content and its end marker, not the earlier assistant turn ("hello")
        assert tok.decode(trained, skip_special_tokens=True).strip() == answer
        assert trained[-1] == tok.eos_token_id
        assert "hello" not in tok.decode(trained)
    first_label = next(i for i, label in enumerate(row["chosen_labels"]) if label != IGNORE)
    assert row["chosen_input_ids"][:first_label] == row["rejected_input_ids"][:first_label]


def test_overlong_pairs_truncate_keeping_the_prompt_or_are_skipped_or_dropped(tok: Any) -> None:
    prompt_len = len(tok(PROMPT, add_special_tokens=False)["input_ids"]) + 1
    long_answer = {**PAIR, "chosen": "z c a d " * 10, "rejected": "d a c z " * 10}
    whole = _tokenize([PAIR], tok).dataset[0]
    tight = max(len(whole["chosen_input_ids"]), len(whole["rejected_input_ids"]))  # PAIR fits, long_answer does not
    out = _tokenize([PAIR, long_answer], tok, max_len=tight)
    assert len(out.dataset) == 2 and out.truncated == 1 and out.no_answer == 0
    assert out.dataset[0] == whole
    cut = out.dataset[1]
    assert len(cut["chosen_input_ids"]) == len(cut["rejected_input_ids"]) == tight
    assert cut["chosen_labels"][:prompt_len] == [IGNORE] * prompt_len  # the prompt is whole
    assert len(_answer_ids(cut["chosen_labels"])) == tight - prompt_len  # the answers are cut at their end

    with pytest.raises(DataError, match="no usable samples"):  # the prompt alone is too long: no answer is left
        _tokenize([long_answer], tok, max_len=prompt_len - 2)
    dropped = _tokenize([PAIR, long_answer], tok, max_len=tight, overlong="drop")
    assert len(dropped.dataset) == 1 and dropped.dropped == 1 and dropped.truncated == 0


def test_a_pair_without_answer_tokens_is_skipped_and_counted(tok: Any) -> None:
    prompt_len = len(tok(PROMPT, add_special_tokens=False)["input_ids"]) + 1
    short_prompt = {"prompt": "Reverse: a b\n", "chosen": "b a", "rejected": "a b"}
    out = _tokenize([short_prompt, PAIR], tok, max_len=prompt_len)  # PAIR's answers are cut off entirely
    assert len(out.dataset) == 1 and out.no_answer == 1 and out.truncated == 1
    assert tok.decode(_answer_ids(out.dataset[0]["chosen_labels"]), skip_special_tokens=True).strip() == "b a"


def test_a_pair_identical_once_cut_is_skipped_and_counted(tok: Any) -> None:
    """Answers that differ only after max_seq_len leave the same tokens on both sides: the DPO/reward loss is ln 2
    whatever the model (nothing to learn), so the pair is skipped and counted like one without answer tokens."""
    prompt_len = len(tok(PROMPT, add_special_tokens=False)["input_ids"]) + 1
    late = {"prompt": PROMPT, "chosen": "a b c d e f g h i j k l m z", "rejected": "a b c d e f g h i j k l m y"}
    out = _tokenize([late, PAIR], tok, max_len=prompt_len + 4)
    assert len(out.dataset) == 1 and out.no_answer == 1 and out.truncated == 2
    row = out.dataset[0]
    assert row["chosen_input_ids"] != row["rejected_input_ids"]  # PAIR's answers differ in their first tokens


BAD_ROWS = [
    ({"prompt": PROMPT, "chosen": "a"}, "missing field 'rejected'"),
    ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
    ({"prompt": " ", "chosen": "a", "rejected": "b"}, "field 'prompt' must be a non-empty string"),
    ({"prompt": PROMPT, "chosen": "same", "rejected": "same"}, "are the same answer"),
    ({"prompt": PROMPT, "chosen": "a", "rejected": 3}, "both be strings or both be message lists"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "w"}]},
     "must share every message but the last assistant turn (they differ at message 0)"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "end with the same assistant turn"),
    ({"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "x"}]},
     "the last message must be the assistant's"),
    ({"prompt": "p", "chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "n"}]},
     "field 'prompt' of a pair of message lists must be a message list too"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}],
      "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "n"}]},
     "chosen[1] needs role in"),
]
ALONE = {"both be strings or both be message lists"}  # its field types differ from a good row's: a file of its own


@pytest.mark.parametrize("bad,message", BAD_ROWS, ids=[m[:30] for _, m in BAD_ROWS])
def test_a_bad_row_fails_with_file_and_line(tmp_path: Path, tok: Any, bad: dict, message: str) -> None:
    good = PAIR if isinstance(bad.get("chosen"), str) else {
        "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}
    path = tmp_path / "pairs.jsonl"
    rows = [bad] if message in ALONE else [good, good, bad]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as info:
        tokenize_rows(load_raw(str(path)), fmt="preference", tokenizer=tok, max_len=128, overlong="truncate",
                      add_bos="auto", source=str(path))
    text = str(info.value)
    assert text.startswith(f"{path}:{len(rows)}: ") and len(text.splitlines()) == 1, text
    assert message in text, text


def test_a_file_without_chosen_or_rejected_names_the_missing_field(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "p", "chosen": "a", "other": "b"}) + "\n")
    with pytest.raises(DataError, match=r"pairs.jsonl:1: missing field 'rejected'"):
        tokenize_rows(load_raw(str(path)), fmt="preference", tokenizer=tok, max_len=64, overlong="truncate",
                      add_bos="auto", source=str(path))


def test_the_collator_makes_one_batch_of_2b_rows_chosen_first() -> None:
    rows = [
        {"chosen_input_ids": [1, 5, 6], "chosen_labels": [IGNORE, 5, 6],
         "rejected_input_ids": [1, 5, 7, 8], "rejected_labels": [IGNORE, 5, 7, 8], "ref_logps": [-1.5, -2.5]},
        {"chosen_input_ids": [1, 9], "chosen_labels": [IGNORE, 9],
         "rejected_input_ids": [1, 3, 4], "rejected_labels": [IGNORE, IGNORE, 4], "ref_logps": [-3.0, -4.0]},
    ]
    batch = PreferenceCollator(pad_id=0)(rows)
    assert batch["pairs"] == 2
    assert batch["input_ids"].tolist() == [[1, 5, 6, 0], [1, 9, 0, 0], [1, 5, 7, 8], [1, 3, 4, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 5, 6, IGNORE], [IGNORE, 9, IGNORE, IGNORE], [IGNORE, 5, 7, 8],
                                        [IGNORE, IGNORE, 4, IGNORE]]
    assert batch["ref_logps"].dtype == torch.float32
    assert batch["ref_logps"].tolist() == [-1.5, -3.0, -2.5, -4.0]
    assert "ref_logps" not in PreferenceCollator(0)([{k: v for k, v in r.items() if k != "ref_logps"} for r in rows])


# --- recipe checks ----------------------------------------------------------------------------------------------


@pytest.fixture
def pref_recipe(write_recipe, minimal_recipe, tmp_path: Path):
    """A valid task: dpo recipe on a pairs file; ``make(overrides)`` -> load_recipe's config."""
    (tmp_path / "pairs.jsonl").write_text(json.dumps(PAIR) + "\n")
    recipe = {**minimal_recipe, "task": "dpo",
              "data": {"format": "preference", "train": "pairs.jsonl", "eval": "pairs.jsonl"},
              "eval": {"metrics": ["preference_accuracy"], "every_steps": 1}}
    path = write_recipe(recipe)

    def make(overrides: list[str] | None = None) -> Any:
        return load_recipe(path, overrides or [])[0]

    return make


def _one_line(make, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        make(overrides)
    lines = str(info.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_dpo_recipe_validates_with_its_defaults(pref_recipe) -> None:
    cfg = pref_recipe()
    assert cfg.task == "dpo" and cfg.data.format == "preference"
    assert (cfg.dpo.beta, cfg.dpo.label_smoothing, cfg.dpo.loss) == (0.1, 0.0, "sigmoid")
    assert pref_recipe(["dpo.loss=ipo", "dpo.beta=0.5"]).dpo.loss == "ipo"


@pytest.mark.parametrize("overrides,expected", [
    (["task=null"], "data.format: preference pairs train task: dpo or task: reward; set task (now null)"),
    (["task=sft"], "data.format: preference pairs train task: dpo or task: reward; set task (now sft)"),
    (["data.format=alpaca", "eval.metrics=[]"], "task: dpo trains on preference pairs; set data.format=preference "
                                                "(got alpaca)"),
    (["data.packing=true"], "data.packing: preference pairs are not packed"),
    (["data.train_on_prompt=true"], "data.train_on_prompt: preference pairs learn from their answers only"),
    (["eval.metrics=[exact_match]"], "eval.metrics: 'exact_match' is not a task dpo metric; use one of "
                                     "['preference_accuracy']"),
    (["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "dpo.loss: ipo takes no label smoothing"),
    (["dpo.beta=0"], "dpo.beta: Input should be greater than 0"),
])
def test_preference_mistakes_are_one_line(pref_recipe, overrides: list[str], expected: str) -> None:
    line = _one_line(pref_recipe, overrides)
    assert line.startswith(expected), line


def test_a_classification_row_cannot_train_dpo(pref_recipe) -> None:
    with pytest.raises(ConfigError) as info:
        pref_recipe(["model.type=bert"])
    lines = str(info.value).splitlines()
    assert "task: bert (classification) cannot train task dpo: it lacks the preference capability; use a causal LM " \
           "model type (finetune models)" in lines, lines
    assert not any(line.startswith(("data.format", "eval.metrics")) for line in lines), lines


def test_preference_accuracy_is_not_a_causal_lm_metric(write_recipe, minimal_recipe) -> None:
    recipe = {**minimal_recipe, "data": {"format": "alpaca", "train": "train.jsonl", "eval": "eval.jsonl"},
              "eval": {"metrics": ["preference_accuracy"]}}
    with pytest.raises(ConfigError, match="'preference_accuracy' is not a causal_lm metric"):
        load_recipe(write_recipe(recipe), [])


def test_the_preference_capability_is_a_causal_lm_one() -> None:
    from finetune import registry

    causal = [row for row in registry.SUPPORTED_MODELS.values() if row.task == "causal_lm"]
    assert causal and all("preference" in row.capabilities for row in causal)
    bert = registry.SUPPORTED_MODELS["bert"]
    import dataclasses

    with pytest.raises(ConfigError, match="preference is a causal_lm capability"):
        registry.register(dataclasses.replace(bert, name="bert-pref", capabilities=bert.capabilities | {"preference"}))
    assert "bert-pref" not in registry.SUPPORTED_MODELS
