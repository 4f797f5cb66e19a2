"""Train the bundled tiny byte-level BPE tokenizer (``finetune/assets/tiny-llama-tokenizer``).

Run after ``scripts/make_datasets.py`` (it trains on the texts in ``recipes/data``)::

    .venv/bin/python scripts/make_datasets.py
    .venv/bin/python scripts/build_tiny_tokenizer.py

Tokenizer facts (all verified at the end of this script):

* Byte-level BPE (``ByteLevel`` pre-tokenizer + decoder, all 256 bytes in the base
  alphabet), so any text encodes without ``<unk>``.
* ``len(tok) == 512``: ids 0-6 are the special tokens ``<pad>`` (0), ``<s>`` (1),
  ``</s>`` (2), ``<unk>`` (3) and the chat role markers ``<|system|>`` (4),
  ``<|user|>`` (5), ``<|assistant|>`` (6); then 256 byte tokens and 249 merges.
* ``tok("text")`` returns ``[<s>] + ids("text")``: a ``<s>`` (id 1) is prepended
  (``add_bos_token=True``), no ``</s>`` is appended (``add_eos_token=False``).
  ``tok("text", add_special_tokens=False)`` returns the bare ids.
  This lives in the ``TemplateProcessing`` post-processor of ``tokenizer.json``.
  Caveat (transformers v5): ``add_bos_token``/``add_eos_token`` are not written to
  ``tokenizer_config.json``, so after a plain ``from_pretrained`` the attribute
  ``tok.add_bos_token`` reads ``False`` even though ``<s>`` is prepended, and setting
  ``tok.add_eos_token = True`` rebuilds the post-processor *without* ``<s>``. Pass
  both explicitly (``from_pretrained(path, add_bos_token=True, add_eos_token=True)``)
  to change the behaviour; ``add_bos_token=False`` disables the ``<s>``.
* Every lowercase letter with a leading space (``" a"`` ... ``" z"``) is exactly one
  token, and the ByteLevel regex splits ``" a b"`` into ``" a"``, ``" b"``, so a
  spaced letter sequence is always one token per letter.
* ``chat_template`` renders ``<|system|>\\n{content}\\n``, ``<|user|>\\n{content}\\n``
  and ``<|assistant|>\\n{content}</s>\\n`` (assistant turns end with the eos token,
  inside a ``{% generation %}`` block so ``return_assistant_tokens_mask`` works);
  ``add_generation_prompt=True`` appends ``<|assistant|>\\n``. The template does
  not emit ``<s>``; ``apply_chat_template(..., tokenize=True)`` does not add it either.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "recipes" / "data"
OUT_DIR = REPO_ROOT / "finetune" / "assets" / "tiny-llama-tokenizer"

VOCAB_SIZE = 512
# data files written after this tokenizer was trained (the tools quickstart's, whose tokenizer is
# scripts/build_tools_tokenizer.py's): left out, so this script still writes the committed tokenizer
LATER = frozenset({"tools_train.jsonl", "tools_eval.jsonl"})
SEED = 4321
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{{- '<|system|>\\n' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|user|>\\n' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' }}"
    "{%- generation %}{{- message['content'] + eos_token }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

_SUBJECTS = [
    "the man",
    "a woman",
    "my friend",
    "the children",
    "our teacher",
    "the farmer",
    "a doctor",
    "the cat",
    "his brother",
    "her mother",
    "the old dog",
    "a student",
    "the people",
    "we",
    "they",
]
_VERBS = [
    "saw",
    "made",
    "found",
    "wanted",
    "took",
    "gave",
    "told",
    "asked",
    "used",
    "brought",
    "liked",
    "opened",
    "moved",
    "kept",
    "called",
    "wrote",
    "read",
    "bought",
    "learned",
    "heard",
]
_OBJECTS = [
    "the book",
    "a letter",
    "some water",
    "the house",
    "a new car",
    "the answer",
    "their work",
    "a long story",
    "the small garden",
    "an old photo",
    "the window",
    "the music",
    "a good idea",
    "the money",
    "the best way",
    "every question",
    "a cup of tea",
    "the first page",
]
_TAILS = [
    "",
    "",
    " yesterday",
    " this morning",
    " at home",
    " in the city",
    " after school",
    " before dinner",
    " with great care",
    " for the first time",
    " because it was important",
    " and then they left",
    " when the sun came up",
    " but nobody knew why",
    " on the way home",
]


def generic_english(n_lines: int, seed: int) -> list[str]:
    """Generate ``n_lines`` simple English sentences (statements and questions)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        subj, verb, obj, tail = (rng.choice(x) for x in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS))
        if i % 5 == 4:
            lines.append(f"Why {rng.choice(['did', 'do'])} {subj} want {obj}{tail}?")
        else:
            line = f"{subj} {verb} {obj}{tail}."
            lines.append(line[0].upper() + line[1:])
    return lines


def dataset_texts() -> Iterator[str]:
    """Yield every text field of the bundled datasets in ``recipes/data``."""
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        if path.name in LATER:
            continue
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if "messages" in row:
                    for message in row["messages"]:
                        yield message["content"]
                else:
                    yield from (str(v) for k, v in row.items() if k != "label")
    csv_path = DATA_DIR / "tiny_classification.csv"
    if csv_path.exists():
        yield from csv_path.read_text(encoding="utf-8").splitlines()[1:]


def training_corpus() -> list[str]:
    """Dataset texts + generic English + spaced alphabet lines (deterministic order)."""
    corpus = list(dataset_texts())
    if len(corpus) < 1000:
        raise SystemExit("recipes/data looks empty: run scripts/make_datasets.py first")
    corpus += generic_english(400, SEED)
    # Guarantee that " a" ... " z" are frequent enough to be merged into single tokens.
    spaced = " ".join(string.ascii_lowercase)
    corpus += [spaced, spaced.upper()] * 100
    return corpus


def train_backend() -> Tokenizer:
    """Train the raw ``tokenizers`` byte-level BPE model."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS + ROLE_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return tokenizer


def wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap the backend in a ``PreTrainedTokenizerFast`` with special tokens and chat template."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=ROLE_TOKENS,
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
        padding_side="right",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def verify(path: Path) -> None:
    """Reload the saved tokenizer with ``AutoTokenizer`` (offline) and check its behaviour."""
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    print(f"loaded {type(tok).__name__} from {path.relative_to(REPO_ROOT)}")
    assert len(tok) == VOCAB_SIZE, len(tok)
    expected_ids = {t: i for i, t in enumerate(SPECIAL_TOKENS + ROLE_TOKENS)}
    actual_ids = {t: tok.convert_tokens_to_ids(t) for t in expected_ids}
    assert actual_ids == expected_ids, actual_ids
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    print(f"len(tok)={len(tok)} special ids={actual_ids}")

    enc = tok("hello world")["input_ids"]
    bare = tok("hello world", add_special_tokens=False)["input_ids"]
    assert enc == [tok.bos_token_id, *bare], (enc, bare)
    print(f"tok('hello world').input_ids={enc} (<s> prepended, no </s>); add_special_tokens=False -> {bare}")
    print(f"tok.add_bos_token attribute after plain load: {tok.add_bos_token} (not persisted by transformers v5)")
    for kwargs, want in (
        ({"add_bos_token": False}, bare),
        ({"add_bos_token": True, "add_eos_token": True}, [tok.bos_token_id, *bare, tok.eos_token_id]),
    ):
        other = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
        assert other("hello world")["input_ids"] == want, kwargs
        print(f"from_pretrained(..., {kwargs}) -> {want}")

    for letter in string.ascii_lowercase:
        ids = tok(f" {letter}", add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, (letter, ids)
        assert len(tok(letter, add_special_tokens=False)["input_ids"]) == 1, letter
    spaced = " ".join(string.ascii_lowercase)
    spaced_ids = tok(spaced, add_special_tokens=False)["input_ids"]
    assert len(spaced_ids) == 26, spaced_ids
    print("' a' ... ' z' are single tokens; 'a b ... z' ->", len(spaced_ids), "tokens")

    prompt = "Reverse the letters.\nk d a q\n"
    answer = "q a d k"
    for text in (prompt + answer, "Unicode ok: café, naïve, 東京, emoji 🙂\n\ttabs  and  spaces"):
        ids = tok(text)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text, tok.decode(ids)
        assert tok.decode(ids) == "<s>" + text
    print(f"round trip ok: {prompt + answer!r} -> {len(tok(prompt + answer)['input_ids'])} tokens")

    conversation = [
        {"role": "user", "content": "Reverse the letters: k d a q"},
        {"role": "assistant", "content": "q a d k"},
    ]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert rendered == "<|user|>\nReverse the letters: k d a q\n<|assistant|>\nq a d k</s>\n", rendered
    print(f"apply_chat_template(conversation):\n{rendered!r}")
    gen = tok.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    assert gen == "<|user|>\nReverse the letters: k d a q\n<|assistant|>\n", gen
    print(f"apply_chat_template(conversation[:1], add_generation_prompt=True):\n{gen!r}")
    with_gen = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    print(f"apply_chat_template(conversation, add_generation_prompt=True):\n{with_gen!r}")
    system = [{"role": "system", "content": "Be brief."}, *conversation]
    print(f"with system message:\n{tok.apply_chat_template(system, tokenize=False)!r}")

    out = tok.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids[0] != tok.bos_token_id, "chat template should not add <s>"
    assistant_ids = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(assistant_ids) == "q a d k</s>", tok.decode(assistant_ids)
    print(f"chat ids={ids}\nassistant mask covers {tok.decode(assistant_ids)!r}")

    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"files: {sorted(f.name for f in path.iterdir())}, total {size / 1024:.1f} KiB")
    assert size < 200 * 1024


def main() -> None:
    """Train, save and verify the tokenizer."""
    tok = wrap(train_backend())
    if OUT_DIR.exists():
        shutil.rmtree(OUT_DIR)
    OUT_DIR.mkdir(parents=True)
    tok.save_pretrained(str(OUT_DIR))
    verify(OUT_DIR)


if __name__ == "__main__":
    main()
