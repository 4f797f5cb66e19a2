"""`finetune generate` on tiny runs trained in this process: greedy and sampled completions equal an independent
one-prompt-at-a-time decoding loop, whatever the target (run, checkpoint, final/, LoRA adapter, merge output);
completions do not depend on the batch size (greedy and sampled); sampling is reproducible per seed; eos cutting and
finish_reason; extra keys are copied; prompts are the text training rendered; every mistake is one line, exit 2.

The run is trained for 2 steps at a tiny lr: close to its random init, its greedy completions are varied, and some
stop at eos while others run to --max-new-tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import DATA, cli_exit_code, trained_run

pytestmark = pytest.mark.integration

ALPACA_ROWS = [json.loads(line) for line in (DATA / "reverse_eval.jsonl").read_text().splitlines()[:8]]
PROMPTS: list[dict[str, Any]] = [
    *({"id": i, **row} for i, row in enumerate(ALPACA_ROWS)),  # alpaca rows, "output" included (copied)
    {"id": 8, "prompt": "### Instruction:\nReverse the letters.\n\n### Input:\nq r s\n\n### Response:\n"},
    {"id": 9, "messages": [{"role": "user", "content": "How many letters are in: a b c?"}]},
    {"id": 10, "prompt": "hello there", "meta": {"tags": ["x", 1], "note": None}},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full-weights run near its random init; its one checkpoint is its final model."""
    return trained_run(tmp_path_factory.mktemp("fresh"), "fresh", train={"max_steps": 2}, optim={"lr": 1.0e-6},
                       data={"eval": None}, checkpoint={"every_steps": 2})


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def generate(*args: Any) -> int:
    """`finetune generate ARGS` through the real entry point in this process; its exit code."""
    return cli_exit_code("generate", *map(str, args))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def reference_ids(row: dict[str, Any], tokenizer: Any) -> list[int]:
    """The prompt's tokens as the libraries give them, independent of finetune: a chat through
    apply_chat_template(tokenize=True), a text (alpaca's template written out by hand) through the tokenizer's own
    call."""
    if "messages" in row:
        return list(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    text = row["prompt"] if "prompt" in row else \
        f"### Instruction:\n{row['instruction']}\n\n### Input:\n{row['input']}\n\n### Response:\n"
    return list(tokenizer(text)["input_ids"])


def one_at_a_time(model_dir: Path, rows: list[dict[str, Any]], max_new_tokens: int, temperature: float = 0.0,
                  seed: int = 0) -> list[tuple[str, str]]:
    """(completion, finish_reason) of each prompt alone: a plain loop with no KV cache, no padding and no batch, on
    the model loaded with transformers. Sampling follows generate's documented recipe: prompt i draws one uniform
    number per token from a generator seeded with ``prompt_seed(seed, i)`` and takes the token where the cumulative
    sum of the descending probabilities first exceeds it."""
    from finetune.commands.generate import prompt_seed

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = []
    for index, row in enumerate(rows):
        ids = reference_ids(row, tokenizer)
        generator = torch.Generator().manual_seed(prompt_seed(seed, index))
        new: list[int] = []
        reason = "length"
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids + new])).logits[0, -1]
                if temperature == 0:
                    token = int(logits.argmax())
                else:
                    probs, order = torch.softmax(logits / temperature, -1).sort(descending=True, stable=True)
                    cdf = probs.cumsum(0)
                    draw = float(torch.rand((), generator=generator)) * float(cdf[-1])
                    token = int(order[int((cdf <= draw).sum())])
                if token == tokenizer.eos_token_id:
                    reason = "eos"
                    break
                new.append(token)
        out.append((tokenizer.decode(new, skip_special_tokens=True), reason))
    return out


def completions(path: Path) -> list[tuple[str, str]]:
    return [(row["completion"], row["finish_reason"]) for row in read_jsonl(path)]


# --- what comes out -----------------------------------------------------------------------------------------------


def test_greedy_equals_one_prompt_at_a_time_for_run_checkpoint_and_export(run: Path, prompts_file: Path,
                                                                          tmp_path: Path) -> None:
    """Each completion is what the model gives the prompt alone, cut at eos (reason eos) or at --max-new-tokens."""
    expected = one_at_a_time(run / "final", PROMPTS, 12)
    assert {reason for _, reason in expected} == {"eos", "length"}, expected  # the test sees both endings
    assert len({text for text, _ in expected if text}) >= 3, expected
    for name, target in (("run", run), ("final", run / "final"), ("checkpoint", run / "checkpoints" / "step-000002")):
        out = tmp_path / f"{name}.jsonl"
        assert generate(target, prompts_file, "-o", out, "--max-new-tokens", 12) == 0
        assert completions(out) == expected, name
    short = one_at_a_time(run / "final", PROMPTS, 2)
    assert generate(run, prompts_file, "-o", tmp_path / "short.jsonl", "--max-new-tokens", 2) == 0
    assert completions(tmp_path / "short.jsonl") == short


def test_sampled_equals_one_prompt_at_a_time(run: Path, prompts_file: Path, tmp_path: Path) -> None:
    expected = one_at_a_time(run / "final", PROMPTS, 8, temperature=1.0, seed=7)
    assert generate(run, prompts_file, "-o", tmp_path / "sampled.jsonl", "--max-new-tokens", 8, "--temperature",
                    "1.0", "--seed", 7) == 0
    assert completions(tmp_path / "sampled.jsonl") == expected


def test_output_lines_are_the_input_objects_plus_the_completion(run: Path, prompts_file: Path, tmp_path: Path
                                                                ) -> None:
    out = tmp_path / "sub" / "out.jsonl"  # the folder is created
    assert generate(run, prompts_file, "-o", out, "--max-new-tokens", 4, "--batch-size", 3) == 0
    rows = read_jsonl(out)
    assert len(rows) == len(PROMPTS)
    for written, given in zip(rows, PROMPTS, strict=True):
        assert list(written) == [*given, "completion", "finish_reason"]
        assert {k: written[k] for k in given} == given
        assert "</s>" not in written["completion"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]  # no .tmp left behind


@pytest.mark.parametrize("sampling", [[], ["--temperature", "1.0", "--top-p", "0.95", "--seed", "3"]],
                         ids=["greedy", "sampled"])
def test_completions_do_not_depend_on_the_batch_size(run: Path, prompts_file: Path, tmp_path: Path,
                                                    sampling: list[str]) -> None:
    """Batch size 1 (each prompt alone), 8 (every position of a batch of 8, then 3) and 4 give the same file."""
    files = []
    for batch in (1, 8, 4):
        files.append(tmp_path / f"b{batch}.jsonl")
        assert generate(run, prompts_file, "-o", files[-1], "--max-new-tokens", 10, "--batch-size", batch,
                        *sampling) == 0
    assert files[0].read_bytes() == files[1].read_bytes() == files[2].read_bytes()


def test_sampling_is_reproducible_per_seed(run: Path, prompts_file: Path, tmp_path: Path) -> None:
    def sampled(name: str, *flags: str) -> list[tuple[str, str]]:
        out = tmp_path / f"{name}.jsonl"
        assert generate(run, prompts_file, "-o", out, "--max-new-tokens", 10, "--temperature", "1.0", *flags) == 0
        return completions(out)

    first, again, other = sampled("a", "--seed", "1"), sampled("b", "--seed", "1"), sampled("c", "--seed", "2")
    assert first == again
    assert first != other
    greedy = sampled("greedy", "--temperature", "0")
    assert first != greedy
    # a nucleus so small that it holds only the most likely token is greedy decoding
    assert sampled("nucleus", "--seed", "1", "--top-p", "1e-9") == greedy


def test_prompts_are_tokenized_as_training_tokenizes_them(run: Path, tmp_path: Path) -> None:
    """The prompt side of alpaca rows and of chat conversations gives the token ids training's tokenizer gives the
    same rows' prompts (finetune.data.tokenize), so a fine-tuned model sees the prompt it learned from."""
    from finetune.commands.generate import prompt_ids, read_prompts
    from finetune.data.loading import load_raw
    from finetune.data.tokenize import tokenize_rows

    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "final")
    chat = [json.loads(line) for line in (DATA / "tiny_chat.jsonl").read_text().splitlines()]
    asked = tmp_path / "chat.jsonl"
    asked.write_text("".join(json.dumps({"messages": row["messages"][:-1]}) + "\n" for row in chat))
    for fmt, source, prompts in (("alpaca", DATA / "reverse_eval.jsonl", DATA / "reverse_eval.jsonl"),
                                 ("chat", DATA / "tiny_chat.jsonl", asked)):
        trained = tokenize_rows(load_raw(str(source)), fmt=fmt, tokenizer=tokenizer, max_len=512, overlong="truncate",
                                add_bos="auto", source=str(source)).dataset["prompt_ids"]
        ours = [prompt_ids(p, tokenizer, None, 512, "auto").ids for p in read_prompts(prompts, fmt)]
        assert ours == [list(ids) for ids in trained], fmt


def test_lora_adapter_and_its_merge_generate_alike(prompts_file: Path, tmp_path: Path) -> None:
    """An adapter run (base + adapter) and the `finetune merge` output of it give the same greedy completions."""
    lora = {"method": "lora", "preset": "attn_mlp", "r": 8, "alpha": 16, "dropout": 0.0}
    adapter_run = trained_run(tmp_path, "lora", peft=lora, optim={"lr": 5e-3}, train={"max_steps": 4},
                              data={"eval": None})
    assert cli_exit_code("merge", str(adapter_run), "-o", str(tmp_path / "merged")) == 0
    for target in (adapter_run, tmp_path / "merged"):
        assert generate(target, prompts_file, "-o", tmp_path / f"{target.name}.jsonl", "--max-new-tokens", 6) == 0
    assert completions(tmp_path / "lora.jsonl") == completions(tmp_path / "merged.jsonl") \
        == one_at_a_time(tmp_path / "merged", PROMPTS, 6)


def test_overwrite_replaces_an_earlier_output(run: Path, prompts_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    assert generate(run, prompts_file, "-o", out, "--max-new-tokens", 2, "--overwrite") == 0
    assert len(read_jsonl(out)) == len(PROMPTS)


# --- the decoder on its own ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=512, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def test_sampling_per_prompt_generators_ignore_the_batch(decoder_llama: Any) -> None:
    """Each prompt sampled in a left-padded batch draws what it draws alone from a generator with its seed."""
    from finetune.data.batching import left_pad
    from finetune.tasks.decoding import Sampling, generate_tokens

    prompts = [[5, 9, 33], [7], [100, 2, 3, 4, 5, 6]]

    def sample(rows: list[list[int]], seeds: list[int]) -> list[list[int]]:
        ids, mask = left_pad(rows, 0)
        sampling = Sampling(1.5, 0.9, [torch.Generator().manual_seed(s) for s in seeds])
        return generate_tokens(decoder_llama, ids, mask, 12, [], 0, sampling).tolist()

    together = sample(prompts, [11, 12, 13])
    assert together == [sample([p], [s])[0] for p, s in zip(prompts, [11, 12, 13], strict=True)]
    assert together != sample(prompts, [21, 22, 23])


def test_stop_tokens_pad_the_row_and_all_stopped_ends_early(decoder_llama: Any) -> None:
    from finetune.data.batching import left_pad
    from finetune.tasks.decoding import generate_tokens

    ids, mask = left_pad([[5, 9, 33], [7, 8]], 0)
    free = generate_tokens(decoder_llama, ids, mask, 10, [], 0).tolist()
    stop = free[0][2]  # make the third token of row 0 a stop token
    rows = generate_tokens(decoder_llama, ids, mask, 10, [stop], 0).tolist()
    early = generate_tokens(decoder_llama, ids, mask, 10, [stop], 0, stop_when_done=True).tolist()
    for free_row, row in zip(free, rows, strict=True):
        cut = free_row.index(stop) + 1 if stop in free_row else len(free_row)
        assert row[:cut] == free_row[:cut] and row[cut:] == [0] * (10 - cut)
    if all(stop in row for row in free):  # both stop: decoding ends at the later stop
        assert [len(r) for r in early] == [max(r.index(stop) for r in free) + 1] * 2
    else:
        assert early == rows


def test_finish_cuts_at_the_first_stop_token() -> None:
    from finetune.commands.generate import finish

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        Path(__file__).resolve().parents[2] / "finetune" / "assets" / "tiny-llama-tokenizer")
    eos = tokenizer.eos_token_id
    words = tokenizer("a b", add_special_tokens=False)["input_ids"]
    assert finish([*words, eos, *words], [eos], tokenizer) == (tokenizer.decode(words), "eos")
    assert finish(words, [eos], tokenizer) == (tokenizer.decode(words), "length")
    assert finish([eos, *words], [eos], tokenizer) == ("", "eos")


# --- mistakes: one line each, exit 2, nothing written ---------------------------------------------------------------


def _bad_prompts(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(("lines", "needles"), [
    (['{"prompt": "a"}', '{"prompt": "b"', '{"prompt": "c"}'], ["bad.jsonl:2", "invalid JSON"]),
    (['{"prompt": "a"}', '{"prompt": "b"}', '{"id": 3}'], ["bad.jsonl:3", "no prompt", "'instruction'"]),
    (['{"prompt": 5}'], ["bad.jsonl:1", "'prompt' must be a string"]),
    (['{"prompt": "a"}', '[1, 2]'], ["bad.jsonl:2", "JSON object"]),
    (['{"prompt": "a"}', ''], ["bad.jsonl:2", "empty line"]),
    (['{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'],
     ["bad.jsonl:1", "assistant's"]),
    (['{"prompt": "a", "messages": [{"role": "user", "content": "hi"}]}'], ["bad.jsonl:1", "both"]),
    (['{"prompt": "a", "completion": "x"}'], ["bad.jsonl:1", "'completion'"]),
    (['{"instruction": ""}'], ["bad.jsonl:1", "'instruction'"]),
], ids=["invalid-json", "no-prompt-key", "prompt-not-text", "not-an-object", "blank-line", "ends-with-assistant",
        "prompt-and-messages", "output-key-taken", "empty-instruction"])
def test_a_bad_prompt_line_is_one_error_naming_file_and_line(run: Path, tmp_path: Path, monkeypatch, capsys,
                                                             lines: list[str], needles: list[str]) -> None:
    out = tmp_path / "out.jsonl"
    result = main_exit(monkeypatch, capsys, "generate", str(run), str(_bad_prompts(tmp_path, *lines)), "-o", str(out))
    assert len(assert_user_error(*result, *needles)) == 1
    assert not out.exists()


def test_output_and_target_mistakes_are_one_line_each(run: Path, prompts_file: Path, tmp_path: Path, monkeypatch,
                                                      capsys) -> None:
    def refused(*args: str, needles: tuple[str, ...], lines: int = 1) -> None:
        result = main_exit(monkeypatch, capsys, "generate", *map(str, args))
        assert len(assert_user_error(*result, *needles)) == lines

    existing = tmp_path / "exists.jsonl"
    existing.write_text("mine\n")
    refused(run, prompts_file, "-o", existing, needles=("already exists", "--overwrite"))
    assert existing.read_text() == "mine\n"
    refused(run, prompts_file, "-o", run / "completions.jsonl", needles=("inside the run",))
    refused(run, prompts_file, "-o", run / "final" / "x.jsonl", needles=("inside the run",))
    refused(run, prompts_file, "-o", prompts_file, "--overwrite", needles=("prompts file",))
    refused(run, prompts_file, "-o", tmp_path, needles=("is a folder",))
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, prompts_file, "-o", tmp_path / "a.jsonl", needles=("recipe.resolved.yaml",))
    refused(tmp_path / "missing", prompts_file, "-o", tmp_path / "a.jsonl", needles=("not a directory",))
    refused(run, tmp_path / "none.jsonl", "-o", tmp_path / "a.jsonl", needles=("none.jsonl", "not found"))
    refused(run, prompts_file, "-o", tmp_path / "a.jsonl", "--temperature", "-1", "--top-p", "0",
            needles=("--temperature -1", "--top-p 0"), lines=2)
    refused(run, prompts_file, "-o", tmp_path / "a.jsonl", "--accelerate-config", "zero3", needles=("shards",))
    refused(run, prompts_file, "-o", tmp_path / "a.jsonl", "--num-processes", "2", "--accelerate-config", "cpu",
            needles=("runs one process",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "exists.jsonl"]
    assert not (run / "completions.jsonl").exists()
