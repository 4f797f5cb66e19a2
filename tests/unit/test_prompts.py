"""Training and ``finetune generate`` render a prompt one way (finetune.data.prompts).

For text (alpaca), chat and vision rows, the ids generate builds from a prompts file equal the ``prompt_ids`` that
training's tokenization stores for the same rows (what eval's exact_match generates from), with the same special
tokens first under either data.add_bos rule and, for a prompt longer than data.max_seq_len, the same kept end. Each
case compares the two sides, so a change of either side's rule alone fails here. """

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from finetune import registry
from finetune.commands.generate import prompt_ids, read_prompts
from finetune.config.schema import ModelConfig
from finetune.data import prompts
from finetune.data.bos import Lead
from finetune.data.loading import load_raw
from finetune.data.tokenize import tokenize_rows
from finetune.errors import DataError
from finetune.runtime.modeling import build_tokenizer, image_inputs

LONG = " ".join(f"word{i}" for i in range(60))  # far over the limits below in tokens


@pytest.fixture(scope="module")
def qwen_vl() -> tuple[Any, Any]:
    row = registry.get_model("tiny-qwen2-vl")
    tokenizer = build_tokenizer(ModelConfig(type="tiny-qwen2-vl"), row)
    return tokenizer, image_inputs(tokenizer, row)


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def trained(path: Path, fmt: str, tokenizer: Any, max_len: int, images: Any = None, rule: str = "auto"
            ) -> list[list[int]]:
    """The prompt_ids training stores (the prompt trained too, so that rows whose prompt fills max_len stay)."""
    data = tokenize_rows(load_raw(str(path)), fmt=fmt, tokenizer=tokenizer, max_len=max_len, overlong="truncate",
                         add_bos=rule, train_on_prompt=True, source=str(path), images=images).dataset
    assert len(data) == len(load_raw(str(path))), "every row kept"
    return [list(ids) for ids in data["prompt_ids"]]


def generated(path: Path, fmt: str | None, tokenizer: Any, max_len: int, images: Any = None, rule: str = "auto"
              ) -> list[list[int]]:
    """The ids generate feeds the model for each line of the prompts file ``path``."""
    return [prompt_ids(p, tokenizer, images, max_len, rule).ids for p in read_prompts(path, fmt)]


@pytest.mark.parametrize("max_len", [512, 64])
def test_alpaca_prompts_are_the_training_prompts(tok: Any, tmp_path: Path, max_len: int) -> None:
    rows = [{"instruction": "Reverse the letters.", "input": "a b c", "output": "c b a"},
            {"instruction": "Say hi.", "output": "hi"},
            {"instruction": LONG, "input": "x", "output": "y"}]
    data = write(tmp_path / "data.jsonl", rows)
    asked = write(tmp_path / "prompts.jsonl", [{k: v for k, v in row.items() if k != "output"} for row in rows])
    ours, theirs = generated(asked, "alpaca", tok, max_len), trained(data, "alpaca", tok, max_len)
    assert ours == theirs
    assert ours[0][0] == tok.bos_token_id and ours[0].count(tok.bos_token_id) == 1
    if max_len == 64:  # over the limit: both keep the end (the cue to answer), and drop the bos with the start
        assert len(ours[2]) == 64 and ours[2][0] != tok.bos_token_id
        assert ours[2][-3:] == tok("### Response:\n", add_special_tokens=False)["input_ids"][-3:]


def test_prompts_in_trl_shapes_are_the_training_prompts(tok: Any, tmp_path: Path) -> None:
    """A recipe whose format was left out takes alpaca prompts (its sources may have been alpaca rows); a
    conversational prompt line (``prompt`` as messages) is the prompt training gives a prompt-completion row."""
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}]
    data = write(tmp_path / "data.jsonl", rows)
    asked = write(tmp_path / "prompts.jsonl", [{"prompt": rows[0]["prompt"]}])
    assert generated(asked, None, tok, 512) == trained(data, "chat", tok, 512)
    alpaca = [{"instruction": "Say hi.", "output": "hi"}]
    data = write(tmp_path / "alpaca.jsonl", alpaca)
    asked = write(tmp_path / "alpaca_prompts.jsonl", [{"instruction": "Say hi."}])
    assert generated(asked, None, tok, 512) == trained(data, "alpaca", tok, 512)


@pytest.mark.parametrize("rule", ["auto", "always"])
@pytest.mark.parametrize("max_len", [512, 20])
def test_chat_prompts_are_the_training_prompts(tok: Any, tmp_path: Path, max_len: int, rule: str) -> None:
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": LONG},
                          {"role": "assistant", "content": "ok"}]}]
    data = write(tmp_path / "data.jsonl", rows)
    asked = write(tmp_path / "prompts.jsonl", [{"messages": row["messages"][:-1]} for row in rows])
    ours, theirs = generated(asked, "chat", tok, max_len, rule=rule), trained(data, "chat", tok, max_len, rule=rule)
    assert ours == theirs
    # auto: the template's render as apply_chat_template tokenizes it (this template writes no bos); always: bos first
    served = tok.apply_chat_template(rows[0]["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    assert ours[0] == (served if rule == "auto" else [tok.bos_token_id, *served])
    assert (len(ours[1]) == max_len) == (max_len == 20)


def test_vision_prompts_are_the_training_prompts(qwen_vl: tuple[Any, Any], tmp_path: Path) -> None:
    """Each image placeholder becomes its image's tokens on both sides; a prompt over the limit keeps its end when
    that holds every image, and is kept whole by training (refused by generate) when the end would cut one."""
    from PIL import Image

    tokenizer, images = qwen_vl
    for name, size in (("a.png", (56, 56)), ("b.png", (56, 84))):
        Image.new("RGB", size, "red").save(tmp_path / name)

    def user(*parts: dict) -> dict:
        return {"role": "user", "content": list(parts)}

    image_a, image_b = {"type": "image", "image": "a.png"}, {"type": "image", "image": "b.png"}
    rows = [
        {"messages": [user(image_a, {"type": "text", "text": "What colour?"}),
                      {"role": "assistant", "content": "red"}]},
        {"messages": [user({"type": "text", "text": "Two:"}, image_a, image_b),
                      {"role": "assistant", "content": "red and red"}]},
        {"messages": [user({"type": "text", "text": LONG}, image_a), {"role": "assistant", "content": "red"}]},
    ]
    data = write(tmp_path / "data.jsonl", rows)
    asked = write(tmp_path / "prompts.jsonl", [{"messages": row["messages"][:-1]} for row in rows])
    ours = generated(asked, "vision_chat", tokenizer, 40, images)
    assert ours == trained(data, "vision_chat", tokenizer, 40, images)
    assert [ids.count(images.image_token_id) for ids in ours] == [4, 4 + 6, 4]
    assert len(ours[2]) == 40  # the long text lost its start; the image at the end is whole
    assert ours == generated(asked, "vision_chat", tokenizer, 40, images)

    cut = write(tmp_path / "cut.jsonl", [{"messages": [user(image_a, {"type": "text", "text": LONG}),
                                                       {"role": "assistant", "content": "red"}]}])
    asked = write(tmp_path / "ask-cut.jsonl", [{"messages": [user(image_a, {"type": "text", "text": LONG})]}])
    (whole,) = trained(cut, "vision_chat", tokenizer, 40, images)
    assert len(whole) > 40 and whole.count(images.image_token_id) == 4
    (prompt,) = read_prompts(asked, "vision_chat")
    assert prompts.vision_prompt(prompts.vision_text(prompt.messages, tokenizer), tokenizer, images, [[1, 4, 4]],
                                 prompt.where, 40, Lead.of(tokenizer, "auto"), templated=True).ids == whole
    with pytest.raises(DataError, match="keeping its end would cut an image"):
        prompt_ids(prompt, tokenizer, images, 40, "auto")


@pytest.mark.parametrize("rule", ["auto", "always"])
def test_a_text_that_starts_with_the_bos_token_gets_no_second_one(tok: Any, rule: str) -> None:
    lead = Lead.of(tok, rule)
    assert prompts.encode("<s>hi", tok, lead, False) == prompts.encode("hi", tok, lead, False)
    assert prompts.encode("hi", tok, lead, False)[0] == tok.bos_token_id  # this tokenizer's own call puts bos first
