"""MFU, tokens/s and memory in every train row, on real CPU runs in this process.

A run with ``train.peak_tflops`` logs, for every step, ``mfu`` = the step's FLOPs / (its seconds x the peak), where the
step's FLOPs are :func:`finetune.runtime.flops.train_flops` on the sample lengths the step really trained: recorded here
from the host batches train_step was given (packed: from the position_ids restarts, not the collator's cu_seq_lens that
the loop reads; padded: the attention mask rows). The packed run (padded to a multiple of 8 by a padding segment, which
is not input) and the padded run train the same samples, so they log the same input tokens and FLOPs per token. Without
the override a CPU run logs no mfu; memory peaks are CUDA-only, so absent here. The counts travel in the step's one
existing all-reduce: each step still calls ``accelerator.reduce`` twice. """

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune import hooks
from finetune.runtime import flops, loop
from finetune.storage.metrics import read_metrics
from tests.integration.conftest import cli_exit_code, recipe_file

pytestmark = pytest.mark.integration

STEPS = 3
PEAK_TFLOPS = 0.01  # a CPU-sized peak: the tiny model's mfu is then a few percent


def _lengths(batch: dict[str, Any]) -> list[int]:
    """The samples' lengths of one host micro-batch, found independently of finetune.runtime.meter."""
    if "position_ids" in batch and "attention_mask" not in batch:  # packed: a sample starts where positions restart
        positions = batch["position_ids"][0].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        lens = [b - a for a, b in itertools.pairwise(starts)]
        labels = batch["labels"][0].tolist()
        if all(label == -100 for label in labels[starts[-2]:]):  # the padding segment of pack_to_multiple_of
            lens = lens[:-1]
        return lens
    return [int(n) for n in batch["attention_mask"].sum(-1).tolist()]


def _run(folder: Path, name: str, **sections: Any) -> dict[str, Any]:
    """Train ``name`` for STEPS steps; returns its train rows, the lengths each step trained, the model's formula
    inputs and the number of accelerator.reduce calls."""
    import accelerate

    windows: list[list[int]] = []
    seen: dict[str, Any] = {}
    reduces = [0]
    original_step, original_reduce = loop.train_step, accelerate.Accelerator.reduce

    def record(t: Any, window: list[dict[str, Any]]) -> Any:
        windows.append([n for batch in window for n in _lengths(batch)])
        return original_step(t, window)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        reduces[0] += 1
        return original_reduce(self, *args, **kwargs)

    def model_of(trainer: Any) -> None:
        seen.setdefault("model", trainer.model)

    hooks.clear()
    hooks.register("after_step", model_of)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loop, "train_step", record)
            patch.setattr(accelerate.Accelerator, "reduce", counted)
            recipe = recipe_file(folder, name, data={"eval": None, **sections.pop("data", {})},
                                 checkpoint={"every_steps": None, "save_final": False}, **sections)
            assert cli_exit_code("run", str(recipe)) == 0
    finally:
        hooks.clear()
    model = seen["model"]
    tied = model.get_input_embeddings().weight.numel() if model.config.tie_word_embeddings else 0
    rows = [row for row in read_metrics(folder / name) if row.get("kind") == "train"]
    return {"rows": rows, "windows": windows, "reduces": reduces[0], "tied": tied,
            "params": flops.params_of(model), "attention": flops.attention_of(model.config)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mfu")


@pytest.fixture(scope="module")
def padded(folder: Path) -> dict[str, Any]:
    return _run(folder, "padded", train={"max_steps": STEPS, "peak_tflops": PEAK_TFLOPS})


@pytest.fixture(scope="module")
def packed(folder: Path) -> dict[str, Any]:
    return _run(folder, "packed", train={"max_steps": STEPS, "peak_tflops": PEAK_TFLOPS},
                data={"packing": True, "pack_to_multiple_of": 8})


@pytest.mark.parametrize("which", ["padded", "packed"])
def test_mfu_is_the_formula_on_the_trained_tokens_over_time_and_peak(which: str, request: pytest.FixtureRequest) \
        -> None:
    run = request.getfixturevalue(which)
    rows, windows = run["rows"], run["windows"]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)) and len(windows) == STEPS
    previous = 0.0
    for row, lens in zip(rows, windows, strict=True):
        step_flops = flops.train_flops(run["params"], run["attention"], lens, tied_head_numel=run["tied"])
        assert step_flops is not None and step_flops > 0
        tokens = sum(lens)
        assert row["flops_per_token"] == pytest.approx(step_flops / tokens, rel=1e-6)
        # elapsed_s is logged to the millisecond: the interval is known to +-1 ms
        low, high = row["elapsed_s"] - previous - 1e-3, row["elapsed_s"] - previous + 1e-3
        peak = PEAK_TFLOPS * 1e12
        assert step_flops / (high * peak) * (1 - 1e-4) <= row["mfu"] <= step_flops / (low * peak) * (1 + 1e-4)
        assert tokens / high - 0.1 <= row["tokens_per_s"] <= tokens / low + 0.1
        previous = row["elapsed_s"]
        assert "mem_alloc_gb" not in row and "mem_reserved_gb" not in row  # CPU: unknown, not 0
    assert run["reduces"] == 2 * STEPS  # the label-token count and the step's one stacked reduce: nothing added


def test_packed_and_padded_runs_count_the_same_input_tokens(padded: dict[str, Any], packed: dict[str, Any]) -> None:
    """The same samples, packed (with a padding segment) or padded: the same lengths, so the same FLOPs per token;
    the padding segment is not counted."""
    assert [sorted(w) for w in packed["windows"]] == [sorted(w) for w in padded["windows"]]
    for a, b in zip(padded["rows"], packed["rows"], strict=True):
        assert a["flops_per_token"] == pytest.approx(b["flops_per_token"], rel=1e-9)
        assert a["target_tokens_per_s"] > 0 and b["target_tokens_per_s"] > 0


def test_no_mfu_without_a_known_peak(folder: Path) -> None:
    """A CPU has no peak in the table: without train.peak_tflops the mfu is omitted, never guessed; the FLOPs per
    token (which need no peak) are still logged."""
    assert not torch.cuda.is_available()
    run = _run(folder, "nopeak", train={"max_steps": 1})
    (row,) = run["rows"]
    assert "mfu" not in row and row["flops_per_token"] > 0 and row["tokens_per_s"] > 0
    assert "mem_alloc_gb" not in row
