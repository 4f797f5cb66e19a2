"""finetune.tasks.causal_lm on a tiny Llama built from its config (forward passes only, no optimizer steps).

Checks that the loss sums and token counts the loop divides agree with Hugging Face's own loss, that the eval counts
(token accuracy, exact match) count what their names say, and that the task's dataloaders shard eval exactly and
stream train. Greedy generation is test_decoding.py; the classification task, test_classification.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import pytest
import torch

from finetune.data import DataBundle
from finetune.data.batching import Collator
from finetune.data.tokenize import IGNORE, Tokenized, tokenize_rows
from finetune.tasks.causal_lm import CausalLMTask, normalize
from tests.task_config import make_cfg

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"
ROWS = [
    {"instruction": "Reverse the letters.", "input": "d a c z", "output": "z c a d"},
    {"instruction": "Reverse the letters.", "input": "b v w c d", "output": "d c w v b"},
    {"instruction": "Say hi.", "input": "", "output": "hi"},
]


@pytest.fixture(scope="module")
def tokenized(tok: Any) -> Tokenized:
    return tokenize_rows(datasets.Dataset.from_list(ROWS), fmt="alpaca", tokenizer=tok, max_len=128,
                         overlong="truncate", add_bos="auto")


@pytest.fixture(scope="module")
def batch(tokenized: Tokenized) -> dict[str, Any]:
    return Collator(pad_id=0, with_prompts=True)(list(tokenized.dataset))


# --------------------------------------------------------------------------------------------------- train loss


def test_causal_train_output_matches_hf_loss(llama: Any, batch: dict[str, Any], tok: Any) -> None:
    task = CausalLMTask(make_cfg(), None, 0, 0, 1, tokenizer=tok)
    with torch.no_grad():
        loss_sum, num_tokens = task.train_output(llama, batch), task.count_targets(batch)
        hf = llama(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    expected_tokens = int((batch["labels"][:, 1:] != IGNORE).sum())
    assert num_tokens == expected_tokens
    # every answer token + eos of every row is a target; no pad, no prompt
    assert expected_tokens == sum(len(tok(r["output"], add_special_tokens=False)["input_ids"]) + 1 for r in ROWS)
    assert loss_sum.dtype == torch.float32 and loss_sum.ndim == 0
    torch.testing.assert_close(loss_sum / num_tokens, hf, rtol=1e-5, atol=1e-5)


def test_causal_train_output_ignores_padding_rows(llama: Any, batch: dict[str, Any], tok: Any) -> None:
    """Sum over a batch == sum of the per-sample sums (padding adds nothing): what token weighting relies on."""
    task = CausalLMTask(make_cfg(), None, 0, 0, 1, tokenizer=tok)
    with torch.no_grad():
        whole, whole_n = task.train_output(llama, batch), task.count_targets(batch)
        rows = [{k: batch[k][i:i + 1] for k in ("input_ids", "attention_mask", "labels")}
                for i in range(batch["input_ids"].size(0))]
        parts = [(task.train_output(llama, row), task.count_targets(row)) for row in rows]
    torch.testing.assert_close(whole, sum(p[0] for p in parts), rtol=1e-5, atol=1e-5)
    assert whole_n == sum(p[1] for p in parts)


# -------------------------------------------------------------------------------------------------- eval counts


class ScriptedModel:
    """A fake causal LM: generation steps emit ``script[row][step]``; teacher-forced calls return ``forced``."""

    def __init__(self, script: list[list[int]], forced: torch.Tensor | None = None, vocab: int = 512) -> None:
        self.script, self.forced, self.vocab, self.step = script, forced, vocab, 0

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool,
                 position_ids: torch.Tensor | None = None, past_key_values: Any = None) -> Any:
        if not use_cache:
            logits = self.forced if self.forced is not None else torch.zeros(*input_ids.shape, self.vocab)
            return SimpleNamespace(logits=logits)
        if past_key_values is None:
            self.step = 0
        logits = torch.zeros(input_ids.size(0), input_ids.size(1), self.vocab)
        for row, tokens in enumerate(self.script):
            logits[row, -1, tokens[min(self.step, len(tokens) - 1)]] = 1.0
        self.step += 1
        return SimpleNamespace(logits=logits, past_key_values=("cache",))


def test_normalize_whitespace() -> None:
    assert normalize("  z  c\n a\td ") == "z c a d"
    assert normalize("") == ""
    assert normalize("z c a d") != normalize("zc a d")


def test_exact_match_counts_normalised_equal_generations(tok: Any, batch: dict[str, Any]) -> None:
    eos = tok.eos_token_id

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    # references: "z c a d", "d c w v b", "hi"
    script = [
        [*ids(" z  c a\nd "), eos, *ids("junk after eos")],  # equal after whitespace normalisation -> counted
        [*ids("d c w v"), eos],                                # one letter short -> not counted
        [*ids("hi"), eos],                                     # exact -> counted
    ]
    width = max(len(s) for s in script)
    task = CausalLMTask(make_cfg(["exact_match"], max_new_tokens=width), None, 0, 0, 1, with_prompts=True,
                        tokenizer=tok)
    counts = task.eval_output(ScriptedModel(script), batch)
    assert int(counts.correct["exact_match"]) == 2 and int(counts.total["exact_match"]) == 3
    assert "token_accuracy" not in counts.correct
    # without an eos, the text after the answer makes it wrong
    no_eos = [[*ids("z c a d"), *ids(" more")], [*ids("d c w v b")] * 2, [*ids("hi"), eos]]
    task.cfg.eval.max_new_tokens = max(len(s) for s in no_eos)
    counts = task.eval_output(ScriptedModel(no_eos), batch)
    assert int(counts.correct["exact_match"]) == 1


def test_exact_match_counts_only_samples_with_a_reference(tok: Any, batch: dict[str, Any]) -> None:
    """A sample of a chat row's earlier turns (reference None) is generated with the others (every rank runs the
    same passes) but is not counted: exact_match answers each row's last turn."""
    eos = tok.eos_token_id

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    script = [[*ids("z c a d"), eos], [*ids("d c w v b"), eos], [*ids("hi"), eos]]  # all three right
    task = CausalLMTask(make_cfg(["exact_match"], max_new_tokens=max(map(len, script))), None, 0, 0, 1,
                        with_prompts=True, tokenizer=tok)
    model = ScriptedModel(script)
    counts = task.eval_output(model, {**batch, "reference": [None, "d c w v b", "hi"]})
    assert (int(counts.correct["exact_match"]), int(counts.total["exact_match"])) == (2, 2)
    counts = task.eval_output(model, {**batch, "reference": [None, None, None]})
    assert (int(counts.correct["exact_match"]), int(counts.total["exact_match"])) == (0, 0)
    assert model.step == max(map(len, script))  # generated all the same


def test_exact_match_stops_at_the_templates_end_of_turn(tok: Any, batch: dict[str, Any]) -> None:
    """A chat template whose end-of-turn marker is a token of its own stops generation as eos does: what follows
    it is not part of the answer."""
    import copy

    from finetune.config.chat_templates import CHATML

    chat = copy.deepcopy(tok)
    chat.chat_template = CHATML
    chat.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    end = chat.convert_tokens_to_ids("<|im_end|>")

    def ids(text: str) -> list[int]:
        return chat(text, add_special_tokens=False)["input_ids"]

    script = [[*ids("z c a d"), end, *ids(" junk")], [*ids("d c w v b"), end, *ids(" more")], [*ids("hi"), end]]
    task = CausalLMTask(make_cfg(["exact_match"], max_new_tokens=max(map(len, script))), None, 0, 0, 1,
                        with_prompts=True, tokenizer=chat)
    assert task.stop_ids == [chat.eos_token_id, end]
    assert int(task.eval_output(ScriptedModel(script, vocab=len(chat)), batch).correct["exact_match"]) == 3


def test_tool_calls_counts_the_rows_whose_last_turn_calls_and_compares_the_calls(tok: Any) -> None:
    """Chat rows tokenized as training does: the row ending in a call stores it (``calls``), the row ending in a
    text answer does not; the metric counts the first only, a right call (arguments in another order) as
    correct."""
    import copy

    chat = copy.deepcopy(tok)
    chat.chat_template = ("{%- for m in messages %}<|{{ m.role }}|>\n{%- if m.tool_calls %}{%- for c in "
                          "m.tool_calls %}<call>{{ c.function | tojson }}</call>{%- endfor %}{%- else %}"
                          "{{ m.content }}{%- endif %}</s>\n{%- endfor %}{%- if add_generation_prompt %}"
                          "<|assistant|>\n{%- endif %}")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}
    rows = [{"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    data = tokenize_rows(datasets.Dataset.from_list(rows), fmt="chat", tokenizer=chat, max_len=128,
                         overlong="truncate", add_bos="auto").dataset
    assert [row["calls"] for row in data] == ['[["get_weather", {"city": "Paris", "unit": "C"}]]', None]
    batch = Collator(pad_id=0, with_prompts=True)(list(data))

    def ids(text: str) -> list[int]:
        return chat(text, add_special_tokens=False)["input_ids"]

    answer = ids('<call>{"name": "get_weather", "arguments": {"unit": "C", "city": "Paris"}}</call>')
    script = [[*answer, chat.eos_token_id], [*ids("Hello."), chat.eos_token_id]]
    task = CausalLMTask(make_cfg(["tool_calls", "exact_match"], max_new_tokens=max(map(len, script))), None, 0, 0,
                        1, with_prompts=True, tokenizer=chat)
    counts = task.eval_output(ScriptedModel(script), batch)
    assert (int(counts.correct["tool_calls"]), int(counts.total["tool_calls"])) == (1, 1)
    assert (int(counts.correct["exact_match"]), int(counts.total["exact_match"])) == (1, 1)  # the text answer
    wrong = ids('<call>{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}</call>')
    task.cfg.eval.max_new_tokens = len(wrong) + 1
    counts = task.eval_output(ScriptedModel([[*wrong, chat.eos_token_id], script[1]]), batch)
    assert (int(counts.correct["tool_calls"]), int(counts.total["tool_calls"])) == (0, 1)


def test_exact_match_stops_at_max_new_tokens(tok: Any, batch: dict[str, Any]) -> None:
    answer = tok("z c a d", add_special_tokens=False)["input_ids"]
    script = [[*answer, tok.eos_token_id], [3], [3]]
    task = CausalLMTask(make_cfg(["exact_match"], max_new_tokens=len(answer) - 1), None, 0, 0, 1, with_prompts=True,
                        tokenizer=tok)
    assert int(task.eval_output(ScriptedModel(script), batch).correct["exact_match"]) == 0
    task.cfg.eval.max_new_tokens = len(answer)
    assert int(task.eval_output(ScriptedModel(script), batch).correct["exact_match"]) == 1


def test_token_accuracy_counts_shifted_label_tokens(llama: Any, tok: Any, batch: dict[str, Any]) -> None:
    task = CausalLMTask(make_cfg(["token_accuracy"]), None, 0, 0, 1, tokenizer=tok)
    labels = batch["labels"]
    targets = int((labels[:, 1:] != IGNORE).sum())
    with torch.no_grad():
        counts = task.eval_output(llama, batch)
        logits = llama(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert int(counts.total["token_accuracy"]) == int(counts.num_tokens) == targets
    hits = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & (labels[:, 1:] != IGNORE)
    assert int(counts.correct["token_accuracy"]) == int(hits.sum())
    train_sum = task.train_output(llama, batch)
    torch.testing.assert_close(counts.loss_sum, train_sum)
    # a model that predicts every next label perfectly gets total/total; predicting position 0 is not counted
    perfect = torch.zeros(*labels.shape, 512)
    next_tokens = labels[:, 1:].clamp(min=0)
    perfect[:, :-1].scatter_(-1, next_tokens[..., None], 1.0)
    counts = task.eval_output(ScriptedModel([], forced=perfect), batch)
    assert int(counts.correct["token_accuracy"]) == int(counts.total["token_accuracy"]) == targets
    # shifting the prediction by one position breaks it
    counts = task.eval_output(ScriptedModel([], forced=perfect.roll(1, dims=1)), batch)
    assert int(counts.correct["token_accuracy"]) < targets


# -------------------------------------------------------------------------------------------------- dataloaders


def test_dataloaders_shard_eval_exactly_and_stream_train(tok: Any) -> None:
    rows = [{"instruction": f"Item {i}.", "output": f"answer {i}"} for i in range(7)]
    data = tokenize_rows(datasets.Dataset.from_list(rows), fmt="alpaca", tokenizer=tok, max_len=64,
                         overlong="truncate", add_bos="auto")
    bundle = DataBundle(train=data, eval=data, labels=None)
    refs: list[str] = []
    for rank in range(3):
        task = CausalLMTask(make_cfg(["exact_match"]), bundle, 0, rank, 3, with_prompts=True, tokenizer=tok)
        assert task.eval_size() == 7
        for batch in task.build_dataloader("eval"):
            assert batch["prompt_ids"].size(0) == len(batch["reference"]) <= 2
            refs.extend(batch["reference"])
    assert sorted(refs) == sorted(r["output"] for r in rows)
    # train: micro-batches of 2 per rank; two ranks together see the same stream as one rank
    def unpadded(batch: dict[str, Any]) -> list[list[int]]:
        assert batch["input_ids"].size(0) == 2
        return [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"],
                                                                strict=True)]

    def first_steps(world: int, start: int = 0) -> list[list[int]]:
        out = []
        for rank in range(world):
            task = CausalLMTask(make_cfg(), bundle, 0, rank, world, tokenizer=tok)
            loader = iter(task.build_dataloader("train", start_sample=start))
            per_step = 4 // world // 2
            out.append([unpadded(next(loader)) for _ in range(3 * per_step)])
        return out

    one = first_steps(1)[0]
    two = first_steps(2)
    assert [b for step in range(3) for b in one[2 * step:2 * step + 2]] == \
        [b for step in range(3) for r in range(2) for b in two[r][step:step + 1]]
    assert first_steps(1, start=4)[0][:4] == one[2:6]
