"""train.compile end to end on CPU: a compiled 2-step tiny-llama run trains like the plain one, and its checkpoint
and export are the same files with the same tensor names; a compiler that fails stops the run in one line.

train.compile compiles each decoder layer (the row's decoder_layer), not the whole model. In the first runs every
training sample is the same, so every batch has the same shape and torch compiles once; the packed run of varied
lengths counts, with dynamo's counters, how often the layers compile (dynamo only, on its eager backend: what is
counted does not depend on the backend).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from finetune.storage.metrics import read_metrics
from tests.cli_helpers import main_exit
from tests.integration.conftest import final_weights, recipe_file, trained_run

pytestmark = pytest.mark.integration

ROW = {"instruction": "Reverse the letters.", "input": "a b c d", "output": "d c b a"}


def _sections(folder: Path, compile_: bool) -> dict[str, Any]:
    """Two steps of one micro-batch on identical samples, a checkpoint at the end, no eval."""
    data = folder / "same.jsonl"
    if not data.exists():
        data.write_text((json.dumps(ROW) + "\n") * 8)
    return {"data": {"train": str(data), "eval": None},
            "train": {"max_steps": 2, "micro_batch_size": 4, "global_batch_size": 4, "compile": compile_},
            "scheduler": {"name": "constant", "warmup_steps": 0}, "checkpoint": {"every_steps": 2}}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch: no compiled code or recompile counts carried over from another test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run without train.compile: what a compiled run must reproduce."""
    folder = tmp_path_factory.mktemp("plain")
    return trained_run(folder, "plain", **_sections(folder, False))


def compile_with(monkeypatch: pytest.MonkeyPatch, backend: Callable[..., Any] | None) -> list[torch.nn.Module]:
    """Record what ``nn.Module.compile`` (what train.compile calls) compiles, and make it use ``backend`` (None: its
    own default, inductor); returns the list of compiled modules."""
    original = torch.nn.Module.compile
    compiled: list[torch.nn.Module] = []

    def compile_(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        compiled.append(self)
        original(self, *args, **(kwargs if backend is None else {**kwargs, "backend": backend}))

    monkeypatch.setattr(torch.nn.Module, "compile", compile_)
    return compiled


def _losses(run: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run) if row["kind"] == "train"]


def assert_same_run(run: Path, plain: Path) -> None:
    """Same losses, same checkpoint files and tensor names, same exported tensors (to float tolerance)."""
    assert _losses(run) == pytest.approx(_losses(plain), rel=1e-5, abs=0) and len(_losses(run)) == 2
    ckpt, plain_ckpt = run / "checkpoints" / "step-000002", plain / "checkpoints" / "step-000002"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in plain_ckpt.iterdir())
    for weights in ckpt.glob("*.safetensors"):
        assert load_file(str(weights)).keys() == load_file(str(plain_ckpt / weights.name)).keys(), weights.name
    exported, reference = final_weights(run), final_weights(plain)
    assert exported.keys() == reference.keys() and not any("_orig_mod" in key for key in exported)
    for key, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[key], rtol=1e-4, atol=1e-5)


def test_compile_trains_on_cpu_like_the_plain_run(plain_run: Path, tmp_path: Path, monkeypatch) -> None:
    """The real default backend (inductor, gcc on CPU), as `finetune run ... train.compile=true` runs it. Takes
    ~35-50 s on 2 busy cores with a cold inductor cache (its C++ kernels), ~6 s with a warm one."""
    compiled = compile_with(monkeypatch, None)
    run = trained_run(tmp_path, "compiled", **_sections(tmp_path, True))
    # each decoder layer, in place (not the whole model: the loss, the embedding and the wrappers' hooks stay eager)
    assert [type(module).__name__ for module in compiled] == ["LlamaDecoderLayer"] * 2
    assert_same_run(run, plain_run)


def test_a_failing_compiler_stops_the_run_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    def no_compiler(graph: Any, example_inputs: Any) -> Any:
        raise RuntimeError("Compiler: cc is not found")  # what inductor says on a machine without a C++ compiler

    compile_with(monkeypatch, no_compiler)
    recipe = recipe_file(tmp_path, "broken", **_sections(tmp_path, True))
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe))
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, err[-3000:]
    assert "Traceback" not in err + out and "internal error" not in err, err[-3000:]
    assert errors == ["error: train.compile: torch.compile failed (RuntimeError: Compiler: cc is not found); set "
                      "train.compile=false to train without it"], errors


def test_packed_rows_of_varied_lengths_compile_the_layers_at_most_twice(tmp_path: Path, monkeypatch) -> None:
    """8 packed micro-batches of varied lengths with data.pack_to_multiple_of=8: the rows take several lengths,
    all multiples of 8, and the decoder layers (one code for all of them) compile at most 2 graphs: the first
    length static, then one with the length dynamic that serves every later length. No compile fails or falls back.
    The run trains the same losses as the uncompiled packed run (rel 1e-5)."""
    from torch._dynamo.utils import counters

    from finetune.data.batching import PackingCollator

    lengths: list[int] = []
    collate = PackingCollator.__call__

    def recording(self: PackingCollator, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = collate(self, rows)
        lengths.append(batch["input_ids"].size(1))
        return batch

    monkeypatch.setattr(PackingCollator, "__call__", recording)
    sections = {"data": {"eval": None, "packing": True, "pack_to_multiple_of": 8},
                "train": {"max_steps": 4, "micro_batch_size": 4, "global_batch_size": 8},
                "scheduler": {"name": "constant", "warmup_steps": 0}}
    plain = trained_run(tmp_path, "plain", **sections)
    compiled = compile_with(monkeypatch, "eager")
    counters.clear()
    lengths.clear()
    run = trained_run(tmp_path, "compiled", **{**sections, "train": {**sections["train"], "compile": True}})
    assert len(compiled) == 2 and len(lengths) == 8
    assert all(n % 8 == 0 for n in lengths) and len(set(lengths)) >= 3, lengths
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert counters["frames"]["total"] == counters["frames"]["ok"], dict(counters["frames"])
    assert _losses(run) == pytest.approx(_losses(plain), rel=1e-5, abs=0) and len(_losses(run)) == 4


def test_deepspeed_with_compile_is_refused_in_one_line(tmp_path: Path) -> None:
    from finetune.config import load_recipe
    from finetune.errors import ConfigError

    sections = _sections(tmp_path, True)
    sections["train"]["global_batch_size"] = 8  # 4 per process
    recipe = recipe_file(tmp_path, "ds", **sections, launch={"accelerate_config": "zero2", "num_processes": 2})
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, [])
    assert str(info.value).splitlines() == [
        "train.compile: not supported with DeepSpeed (launch.accelerate_config=zero2): its engine would have to "
        "compile the model itself; set train.compile=false, or use ddp or fsdp2"]
