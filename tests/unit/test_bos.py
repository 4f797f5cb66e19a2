"""What goes before a text's tokens (finetune.data.bos, data.add_bos), checked against the libraries' own calls.

Under ``auto`` a chat (a training sample, its generation prompt, a chat preference pair, a GRPO chat prompt, a
``finetune generate`` chat prompt, a vision chat) is exactly ``tokenizer.apply_chat_template(..., tokenize=True)``'s
tokens: what vLLM and every Hugging Face consumer feed the exported model. Raw text (completion, alpaca, string
pairs, text prompts) is exactly ``tokenizer(text)``'s tokens (+ eos where the format learns one). Each shipped
tokenizer is tried as it is (its template writes no bos; tiny-llama's own call puts bos first, tiny-qwen2-vl's puts
id 1 first without naming a bos token), with a template that writes bos, and without the tokenizer's own bos.
``always`` (finetune before data.add_bos) puts bos first unless the text starts with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import processors

from finetune import registry
from finetune.commands.generate import prompt_ids, read_prompts
from finetune.config.schema import ModelConfig
from finetune.data.bos import Lead, own_lead
from finetune.data.loading import load_raw
from finetune.data.prompt_rows import PromptOptions
from finetune.data.tokenize import tokenize_rows
from finetune.runtime.modeling import build_tokenizer, image_inputs

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "finetune" / "assets"


def _tiny_llama() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(ASSETS / "tiny-llama-tokenizer"))


def _writes_bos() -> Any:
    tok = _tiny_llama()
    tok.chat_template = "{{ bos_token }}" + tok.chat_template  # as Llama 3's and Gemma's templates do
    return tok


def _no_own_bos() -> Any:
    tok = _tiny_llama()
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # GPT-2's way: a bos, never added
    return tok


def _qwen_vl() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(ASSETS / "tiny-qwen2-vl"))


TOKENIZERS: dict[str, Callable[[], Any]] = {"tiny-llama": _tiny_llama, "template-writes-bos": _writes_bos,
                                            "no-own-bos": _no_own_bos, "tiny-qwen2-vl": _qwen_vl}
CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6"}],
]


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def served(tok: Any, messages: list[dict], generation: bool = False) -> list[int]:
    """The reference: the chat's tokens as apply_chat_template gives them to every server."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True,
                                        return_dict=False))


def legacy(tok: Any, ids: list[int]) -> list[int]:
    """``always`` written plainly: bos first unless the tokenizer has none or the ids start with it."""
    bos = tok.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


def tokenized(tok: Any, path: str, fmt: str, rule: str, **kwargs: Any) -> Any:
    return tokenize_rows(load_raw(path), fmt=fmt, tokenizer=tok, max_len=512, overlong="truncate", add_bos=rule,
                         source=path, **kwargs).dataset


@pytest.mark.parametrize("rule", ["auto", "always"])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_chat_is_apply_chat_templates_tokens(tmp_path: Path, name: str, rule: str) -> None:
    tok = TOKENIZERS[name]()
    expect = (lambda ids: ids) if rule == "auto" else (lambda ids: legacy(tok, ids))
    data = tokenized(tok, write(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS]), "chat", rule)
    assert data["input_ids"] == [expect(served(tok, m)) for m in CHATS]
    assert data["prompt_ids"] == [expect(served(tok, m[:-1], True)) for m in CHATS]
    # the same prompts for finetune generate and for task grpo's chat prompt rows
    asked = write(tmp_path / "asked.jsonl", [{"messages": m[:-1]} for m in CHATS])
    assert [prompt_ids(p, tok, None, 512, rule).ids for p in read_prompts(Path(asked), "chat")] == \
        data["prompt_ids"]
    grpo = tokenized(tok, write(tmp_path / "grpo.jsonl", [{"messages": m[:-1]} for m in CHATS]), "prompt", rule,
                     prompt=PromptOptions(8))
    assert grpo["input_ids"] == data["prompt_ids"]
    # a chat preference pair: each side is its whole conversation
    rejected = [[*m[:-1], {"role": "assistant", "content": "no"}] for m in CHATS]
    pairs = tokenized(tok, write(tmp_path / "pairs.jsonl", [{"chosen": c, "rejected": r}
                                                             for c, r in zip(CHATS, rejected, strict=True)]),
                      "preference", rule)
    assert pairs["chosen_input_ids"] == [expect(served(tok, m)) for m in CHATS]
    assert pairs["rejected_input_ids"] == [expect(served(tok, m)) for m in rejected]


@pytest.mark.parametrize("rule", ["auto", "always"])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_raw_text_is_the_tokenizers_own_call(tmp_path: Path, name: str, rule: str) -> None:
    tok = TOKENIZERS[name]()
    eos = tok.eos_token_id

    def own(text: str) -> list[int]:  # auto: the tokenizer's own call; always: bos first
        return tok(text)["input_ids"] if rule == "auto" else \
            legacy(tok, tok(text, add_special_tokens=False)["input_ids"])

    texts = ["plain words here", "two\nlines", tok.bos_token + "starts with bos" if tok.bos_token else "x"]
    completion = tokenized(tok, write(tmp_path / "c.jsonl", [{"text": t} for t in texts]), "completion", rule)
    written_bos = [own(t) if not (tok.bos_token and t.startswith(tok.bos_token)) else
                   tok(t, add_special_tokens=False)["input_ids"] for t in texts]  # never a second bos
    assert completion["input_ids"] == [[*ids, eos] for ids in written_bos]
    rows = [{"instruction": "Reverse the letters.", "input": "a b", "output": "b a"}]
    alpaca = tokenized(tok, write(tmp_path / "a.jsonl", rows), "alpaca", rule)
    prompt = "### Instruction:\nReverse the letters.\n\n### Input:\na b\n\n### Response:\n"
    assert alpaca["input_ids"] == [[*own(prompt + "b a"), eos]] and alpaca["prompt_ids"] == [own(prompt)]
    pairs = tokenized(tok, write(tmp_path / "p.jsonl", [{"prompt": "Q: ", "chosen": "yes", "rejected": "no"}]),
                      "preference", rule)
    assert pairs["chosen_input_ids"] == [[*own("Q: yes"), eos]]
    assert pairs["rejected_input_ids"] == [[*own("Q: no"), eos]]
    grpo = tokenized(tok, write(tmp_path / "g.jsonl", [{"prompt": "2+2="}]), "prompt", rule, prompt=PromptOptions(8))
    asked = write(tmp_path / "asked.jsonl", [{"prompt": "2+2="}])
    assert grpo["input_ids"] == [own("2+2=")] == \
        [prompt_ids(p, tok, None, 512, rule).ids for p in read_prompts(Path(asked), "completion")]


def test_what_the_tokenizers_own_call_puts_first_is_read_from_it() -> None:
    assert own_lead(_tiny_llama()) == (1,) and own_lead(_no_own_bos()) == ()
    qwen = _qwen_vl()
    assert qwen.bos_token is None and own_lead(qwen) == (1,)  # a post-processor's token, named or not
    tok = _tiny_llama()
    assert Lead.of(tok, "auto").ids("<s>x", templated=False) == ()  # a text that writes bos gets no second one
    assert Lead.of(tok, "auto").ids("x", templated=True) == ()
    assert Lead.of(tok, "always").ids("x", templated=True) == (1,)
    with pytest.raises(ValueError, match=r"data\.add_bos: 'sometimes' is not one of auto, always"):
        Lead.of(tok, "sometimes")


@pytest.mark.parametrize("rule", ["auto", "always"])
def test_a_vision_chat_is_apply_chat_templates_tokens_with_each_image_expanded(tmp_path: Path, rule: str) -> None:
    from PIL import Image

    from finetune.data.vision import for_template

    row = registry.get_model("tiny-qwen2-vl")
    tok = build_tokenizer(ModelConfig(type="tiny-qwen2-vl"), row)
    images = image_inputs(tok, row)
    Image.new("RGB", (56, 56), "red").save(tmp_path / "a.png")
    messages = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Colour?"}]},
                {"role": "assistant", "content": "red"}]
    data = tokenized(tok, write(tmp_path / "v.jsonl", [{"messages": messages}]), "vision_chat", rule, images=images)

    def one_placeholder(ids: list[int]) -> list[int]:  # each image's run of tokens back to its one placeholder
        return [t for i, t in enumerate(ids) if t != images.image_token_id or ids[i - 1] != images.image_token_id]

    # tiny-qwen2-vl names no bos token: always adds nothing either
    assert one_placeholder(data["input_ids"][0]) == served(tok, for_template(messages))
    assert one_placeholder(data["prompt_ids"][0]) == served(tok, for_template(messages[:-1]), True)
