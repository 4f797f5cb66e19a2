"""finetune.runtime.meter and tracking.Throughput: the counts and arithmetic behind tokens_per_s, flops_per_token, mfu
and the memory fields of a train row (the end-to-end check on real runs is tests/integration/test_mfu.py)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.data.batching import Collator, PackingCollator
from finetune.runtime import flops, meter
from finetune.runtime.tracking import Throughput, format_train_line

LENGTHS = [3, 4]


def _rows() -> list[dict[str, list[int]]]:
    return [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in LENGTHS]


def test_input_lengths_count_samples_not_padding() -> None:
    """Padded rows: the attention mask; packed rows: each sample, and pack_to_multiple_of's padding segment (the 8th
    token here) is left out only when the run pads to a multiple."""
    squares = sum(n * n for n in LENGTHS)
    assert meter.input_lengths(Collator(0)(_rows())) == (sum(LENGTHS), squares)
    packed = PackingCollator(multiple=8)(_rows())
    assert packed["input_ids"].shape[1] == 8
    assert meter.input_lengths(packed, padded_tail=True) == (sum(LENGTHS), squares)
    assert meter.input_lengths(packed) == (8, squares + 1)  # without the setting, a segment is a sample
    assert meter.input_lengths(PackingCollator()(_rows()), padded_tail=True) == (sum(LENGTHS), squares)


def test_throughput_rates_per_device() -> None:
    """Two ranks, 2 s since the baseline, two steps of 100 input tokens and 1000 squared lengths each (summed over
    ranks), 50 target tokens: per device 50 input and 12.5 target tok/s; FLOPs 10 x 200 + 2 x 2000 = 6000, 30 per
    token, 6000 / 2 s / 2 devices / peak 1000 = 1.5."""
    rates = Throughput(processes=2, flops=meter.StepFlops(per_token=10, per_square=2, peak=1e3))
    rates.add(100, 1000)
    rates.add(100, 1000)
    assert rates.rates(50, 2.0) == {"tokens_per_s": 50.0, "target_tokens_per_s": 12.5, "flops_per_token": 30.0,
                                    "mfu": 1.5}
    rates.add(100, 1000)  # the next row counts only the steps since this one
    assert rates.rates(75, 3.0)["tokens_per_s"] == 50.0
    no_peak = Throughput(flops=meter.StepFlops(per_token=10, per_square=2, peak=None))
    no_peak.add(10, 10)
    assert "mfu" not in no_peak.rates(5, 1.0)
    no_model = Throughput()
    no_model.add(10, 10)
    assert no_model.rates(5, 1.0) == {"tokens_per_s": 10.0, "target_tokens_per_s": 5.0}


def test_the_step_line_shows_mfu_and_memory_when_present() -> None:
    row = {"step": 10, "loss": 2.31, "lr": 3e-4, "grad_norm": 1.02, "tokens_per_s": 5120.0, "mfu": 0.4134,
           "mem_alloc_gb": 61.23, "mem_reserved_gb": 70.0}
    assert format_train_line(row, max_steps=200) == (
        "step 10/200 | loss 2.3100 | lr 3.00e-04 | grad_norm 1.02 | tok/s 5120 | mfu 41.3% | mem 61.2/70.0 GB")


def _llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def test_step_flops_is_the_formula_for_any_lengths_tied_or_partitioned() -> None:
    """StepFlops (two coefficients) equals flops.train_flops on the lengths themselves; a tied head costs what an
    untied head of the same size costs; ZeRO-3's empty placeholders (``ds_shape``) and packed 4-bit weights
    (``quant_state.shape``) count their whole sizes; the CPU has no peak unless train.peak_tflops gives one."""
    untied = _llama(tied=False)
    want = flops.train_flops(flops.params_of(untied), flops.attention_of(untied.config), [5, 17, 64])
    cpu = torch.device("cpu")
    got = meter.step_flops(untied, None, cpu)
    assert got is not None and got.peak is None
    assert got.of(5 + 17 + 64, 25 + 289 + 4096) == want
    tied = _llama(tied=True)
    assert meter.step_flops(tied, 2.0, cpu) == meter.StepFlops(got.per_token, got.per_square, 2.0e12)
    quantized = _llama(tied=False)
    for name, param in quantized.named_parameters():  # a 4-bit weight: two values per byte, its shape in quant_state
        if name.endswith("proj.weight"):
            param.quant_state = type("QuantState", (), {"shape": param.shape})()
            param.data = torch.empty(param.numel() // 2, 1)
    assert meter.step_flops(quantized, None, cpu) == got
    for param in untied.parameters():  # as deepspeed.zero.Init leaves them
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    assert meter.step_flops(untied, None, cpu) == got


def test_memory_peaks_are_absent_off_cuda() -> None:
    assert meter.memory_peaks(torch.device("cpu")) == {}
