"""Train the bundled tiny tool-calling tokenizer (``finetune/assets/tiny-tools-tokenizer``), the tools quickstart's.

Run after ``scripts/make_datasets.py`` (it trains on the tool-calling rows in ``recipes/data``, rendered with the
``hermes`` chat template)::

    .venv/bin/python scripts/make_datasets.py
    .venv/bin/python scripts/build_tools_tokenizer.py

Facts (verified at the end of this script):

* Byte-level BPE, all 256 bytes in the base alphabet (any text encodes, no ``<unk>``), at most 1024 tokens (the
  merges run out before on so small a corpus; the row's embedding has 1024 rows): ids 0-5 are ``<pad>``, ``<s>``,
  ``</s>``, ``<unk>``, ``<|im_start|>``, ``<|im_end|>``; the merges come from the tool rows rendered with their
  tools (the schemas, the requests, the calls) and the bundled chat rows.
* ``eos_token`` is ``<|im_end|>`` (id 5), the end of an assistant turn, as Qwen's chat tokenizers have it; the
  tokenizer adds no special token of its own (``tok(text)`` is the text's ids).
* ``chat_template`` is finetune's ``hermes`` (ChatML with Hermes function calling).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from finetune.config.chat_templates import HERMES

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "recipes" / "data"
OUT_DIR = REPO_ROOT / "finetune" / "assets" / "tiny-tools-tokenizer"
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]


def corpus() -> list[str]:
    """The tool rows of the training file, each rendered with the hermes template (tools given), and the bundled
    chat rows' texts."""
    render = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    render.chat_template = HERMES
    texts = []
    for line in (DATA_DIR / "tools_train.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        texts.append(render.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False))
    for line in (DATA_DIR / "tiny_chat.jsonl").read_text(encoding="utf-8").splitlines():
        texts += [message["content"] for message in json.loads(line)["messages"]]
    return texts


def build() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                  unk_token="<unk>", extra_special_tokens=["<|im_start|>", "</s>"],
                                  clean_up_tokenization_spaces=False, model_max_length=2048, padding_side="right")
    tok.chat_template = HERMES
    return tok


def verify(path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert len(tok) <= VOCAB_SIZE, len(tok)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 5)
    row = json.loads((DATA_DIR / "tools_eval.jsonl").read_text(encoding="utf-8").splitlines()[0])
    text = tok.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert tok.apply_chat_template(row["messages"], tools=row["tools"], tokenize=True)["input_ids"] == ids
    print(f"len(tok)={len(tok)}; an eval row renders to {len(ids)} tokens ({len(text)} characters)")


def main() -> None:
    tok = build()
    if OUT_DIR.exists():
        shutil.rmtree(OUT_DIR)
    tok.save_pretrained(str(OUT_DIR))
    verify(OUT_DIR)
    print(f"wrote {OUT_DIR.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
