"""The throughput benchmark's pure helpers (scripts/bench_throughput.py): lengths, texts, collators and the sanity
checks that keep a wrong variant from reporting a number. Nothing here trains."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
import torch

from tests.cli_helpers import load_script

bt = load_script("bench_throughput.py", "bench_throughput")

SAMPLES = [
    {"input_ids": [1, 10, 11, 2], "labels": [-100, 10, 11, 2]},
    {"input_ids": [1, 20, 2], "labels": [-100, 20, 2]},
    {"input_ids": [1, 30, 31, 32, 33, 2], "labels": [-100, -100, 31, 32, 33, 2]},
]


def test_lognormal_lengths_are_seeded_clipped_and_centred() -> None:
    lengths = bt.lognormal_lengths(2001, median=96, sigma=0.75, min_len=8, max_len=512, seed=0)
    assert lengths == bt.lognormal_lengths(2001, median=96, sigma=0.75, min_len=8, max_len=512, seed=0)
    assert lengths != bt.lognormal_lengths(2001, median=96, sigma=0.75, min_len=8, max_len=512, seed=1)
    assert min(lengths) >= 8 and max(lengths) == 512  # sigma 0.75: about 1% of draws exceed 512 and are clipped
    assert 86 <= statistics.median(lengths) <= 106


def test_texts_tokenize_to_their_target_lengths() -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(bt.TOKENIZER_ASSETS)
    targets = [8, 20, 57, 130]
    rows = bt.completion_rows(targets, tokenizer, seed=3)
    assert rows == bt.completion_rows(targets, tokenizer, seed=3)
    counts = [len(tokenizer(row["text"], add_special_tokens=False)["input_ids"]) + 2 for row in rows]
    assert all(abs(count - target) <= 1 for count, target in zip(counts, targets, strict=True)), counts
    words = bt.word_list(50, seed=0)
    assert len(set(words)) == 50 and all(w.isalpha() and w.islower() for w in words)
    assert bt.text_of_tokens(5, tokenizer, random.Random(0), words)


def test_pad_collate_right_pads_with_a_mask_and_ignored_labels() -> None:
    batch = bt.pad_collate(SAMPLES, pad_id=0)
    assert batch["input_ids"].shape == (3, 6)
    assert batch["input_ids"][1].tolist() == [1, 20, 2, 0, 0, 0]
    assert batch["attention_mask"].sum(1).tolist() == [4, 3, 6]
    assert batch["labels"][0].tolist() == [-100, 10, 11, 2, -100, -100]
    assert batch["labels"][2].tolist() == SAMPLES[2]["labels"]


def test_pack_collate_is_one_padding_free_row_with_restarting_positions() -> None:
    batch = bt.pack_collate(SAMPLES)
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no attention mask
    assert batch["input_ids"].shape == (1, 13)
    assert batch["input_ids"][0].tolist() == [t for s in SAMPLES for t in s["input_ids"]]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5]
    # each sample's first label is ignored: no target crosses a boundary, and the targets equal the padded batch's
    assert batch["labels"][0].tolist() == [-100, 10, 11, 2, -100, 20, 2, -100, -100, 31, 32, 33, 2]
    padded = bt.pad_collate(SAMPLES, pad_id=0)["labels"]
    assert int((batch["labels"][:, 1:] != -100).sum()) == int((padded[:, 1:] != -100).sum()) == bt.count_targets(
        SAMPLES) == 9


def test_step_batches_keep_order_and_drop_an_incomplete_tail() -> None:
    items = [{"input_ids": [i], "labels": [i]} for i in range(7)]
    batches = bt.step_batches(items, 3)
    assert [[s["input_ids"][0] for s in b] for b in batches] == [[0, 1, 2], [3, 4, 5]]


def test_parse_variants() -> None:
    assert bt.parse_variants("raw_padded, finetune_packed") == ["raw_padded", "finetune_packed"]
    with pytest.raises(Exception, match="unknown variant"):
        bt.parse_variants("raw_padded,hf")


def _bench(samples: list[dict], micro_batch: int = 1) -> object:
    work = bt.Workload(layers=1, hidden=8, heads=1, intermediate=8, vocab=64, samples=len(samples), median_len=4,
                       max_len=8, micro_batch=micro_batch, warmup_steps=1)
    return bt.Bench(work, Path("."), Path("."), Path("."), torch.device("cpu"), None, samples, ref_loss=2.0)


def _trace(feeds: list[tuple[int, int, int]], losses: list[float], step_s: float = 0.5) -> object:
    clock = bt.StepClock(torch.device("cpu"))
    clock.times = [step_s * i for i in range(1, len(feeds) + 1)]
    meter = bt.FeedMeter()
    for fed, attended, seqs in feeds:
        meter.fed.append(fed)
        meter.attended.append(torch.tensor(attended))
        meter.seqs.append(seqs)
    return bt.Trace(clock, meter, [torch.tensor(x) for x in losses])


def test_checks_measure_a_correct_variant() -> None:
    bench = _bench(SAMPLES)  # 3 steps of 1 sample: 4, 3 and 6 tokens; the first step is warm-up
    row = bt.check_and_measure("raw_padded", _trace([(8, 4, 1), (8, 3, 1), (8, 6, 1)], [2.0005, 1.9, 1.8]), bench)
    assert row.steps_timed == 2 and row.wall_s == pytest.approx(1.0)
    assert row.tok_s == pytest.approx(9.0) and row.non_pad == pytest.approx(9 / 16)
    assert row.first_loss == pytest.approx(2.0005) and row.final_loss == pytest.approx(1.8)


@pytest.mark.parametrize(("name", "feeds", "losses", "message"), [
    ("raw_padded", [(4, 4, 1), (3, 3, 1)], [2.0, 1.9], "2 steps timed, expected 3"),
    ("raw_padded", [(4, 4, 1), (3, 3, 1), (6, 5, 1)], [2.0, 1.9, 1.8], "step 3 attended 5 tokens"),
    ("raw_padded", [(4, 4, 1), (6, 6, 1), (3, 3, 1)], [2.0, 1.9, 1.8], "step 2 attended 6 tokens"),  # order
    ("raw_padded", [(4, 4, 2), (3, 3, 1), (6, 6, 1)], [2.0, 1.9, 1.8], "step 1 fed 2 samples"),
    ("raw_packed", [(4, 4, 1), (8, 3, 1), (6, 6, 1)], [2.0, 1.9, 1.8], "fed 5 pad tokens"),
    ("raw_padded", [(4, 4, 1), (3, 3, 1), (6, 6, 1)], [2.002, 1.9, 1.8], "first-step loss 2.002000 differs"),
    ("raw_padded", [(4, 4, 1), (3, 3, 1), (6, 6, 1)], [float("nan"), 1.9, 1.8], "first-step loss nan"),
])
def test_checks_refuse_a_variant_that_did_other_work(name: str, feeds: list, losses: list, message: str) -> None:
    with pytest.raises(bt.CheckFailed, match=message):
        bt.check_and_measure(name, _trace(feeds, losses), _bench(SAMPLES))


def test_table_has_ratios_and_error_rows() -> None:
    bench = _bench(SAMPLES)
    rows = [bt.Row("raw_padded", tok_s=100.0, non_pad=0.5, rounds=[90.0, 100.0]),
            bt.Row("raw_packed", tok_s=200.0, non_pad=1.0, rounds=[200.0]),
            bt.Row("finetune_packed", error="data.packing: not available")]
    table = bt.markdown_table(rows, bench, "peak RSS growth MiB").splitlines()
    assert table[2].startswith("| raw_padded | 100 | 90 / 100 | 1.00x | 0.50x | - | - | - | 0.500 |")
    assert table[3].startswith("| raw_packed | 200 | 200 | 2.00x | 1.00x | - | - | - | 1.000 |")
    assert table[4].startswith("| finetune_packed | error: data.packing: not available |")


def test_step_best_takes_each_steps_fastest_round_and_ratios_use_it() -> None:
    bench = _bench(SAMPLES)
    slow_first = bt.check_and_measure("raw_padded", _trace([(8, 4, 1), (8, 3, 1), (8, 6, 1)], [2.0, 1.9, 1.8]), bench)
    slow_first.step_s = [2.0, 0.5]  # the same 9 tokens: one round slow on step 2, the other on step 3
    slow_last = bt.Row("raw_padded", step_s=[1.0, 1.5], useful=slow_first.useful)
    assert slow_first.useful == 9
    assert bt.step_best([slow_first, slow_last]) == pytest.approx(9 / (1.0 + 0.5))
    by_name = {"raw_padded": bt.Row("raw_padded", tok_s=10.0, steps_best=6.0),
               "raw_packed": bt.Row("raw_packed", tok_s=20.0, steps_best=12.0)}
    mine = bt.Row("finetune_padded", tok_s=9.0, steps_best=6.6)
    assert bt._ratio(mine, by_name, "raw_padded") == "0.90x"
    assert bt._ratio(mine, by_name, "raw_padded", "steps_best") == "1.10x"
    assert bt._ratio(mine, by_name, "raw_packed", "steps_best") == "0.55x"


def test_run_rounds_keeps_the_fastest_round_and_the_per_step_best(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = iter([bt.Row("raw_padded", tok_s=9 / 2.5, step_s=[2.0, 0.5], useful=9),
                   bt.Row("raw_padded", tok_s=9 / 2.5, step_s=[1.0, 1.5], useful=9),
                   bt.Row("raw_padded", tok_s=9 / 3.0, step_s=[1.5, 1.5], useful=9)])
    monkeypatch.setattr(bt, "run_variant", lambda name, bench: next(rounds))
    [row] = bt.run_rounds(["raw_padded"], _bench(SAMPLES), 3)
    assert row.rounds == pytest.approx([3.6, 3.6, 3.0])
    assert row.tok_s == pytest.approx(3.6) and row.steps_best == pytest.approx(9 / 1.5)
