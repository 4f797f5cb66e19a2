"""Elastic resume: a checkpoint of any backend continues on another world size, and on another backend, through the
portable state (finetune.artifacts.portable), with the losses and weights of the run that never stopped.

The straight 8-step, 2-process runs of tests/distributed/test_backends.py (checkpoints at steps 4 and 8) are
reused: a copy of one is resumed from step 4 on the new layout and must end where the straight run ended.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetune.storage import rundir
from finetune.storage.metrics import read_metrics
from tests.distributed.test_backends import (
    BACKENDS,
    CHECKPOINT_BACKENDS,
    _finetune,
    _losses,
    _straight_run,
    copy_with_payload,
    lora_reference,
    lora_run,
    reference,
    resumed_copy,
    workdir,
)
from tests.integration.conftest import final_weights, max_rel_diff

pytestmark = pytest.mark.distributed
__all__ = ["lora_reference", "reference", "workdir"]  # fixtures shared with test_backends
TOL = 1e-5


def _assert_continues(run: Path, straight: Path, saved: str, saved_world: int, now: str, world: int) -> None:
    """Steps 1..8 logged once, the resumed steps' losses and the final weights within TOL of ``straight``; the
    resume went through the portable state unless whole tensors moved between single and ddp (their native load
    reads any world size); the checkpoint written after it records the new layout; no scratch is left behind."""
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == list(range(1, 9))
    assert _losses(run) == pytest.approx(_losses(straight), rel=TOL)
    assert max_rel_diff(final_weights(straight), final_weights(run)) <= TOL
    log = (run / "train.log").read_text()
    native = {saved, now} <= {"single", "ddp"}
    assert (f"resharded from {saved} on {saved_world} process(es) to {now} on {world}" in log) is not native
    layout = json.loads((run / "checkpoints" / "step-000008" / "manifest.json").read_text())["layout"]
    assert (layout["backend"], layout["world_size"]) == (now, world)
    assert not rundir.reshard_scratch(run).exists() and rundir.foreign_entries(run) == []


# zero1/zero3_offload: their files are read below; ddp, fsdp1 and zero2 (their layouts also read below, zero2's on
# the portable path too) run in make test-all (CI time)
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.extended) if b in ("ddp", "fsdp1", "zero2")
                                     else b
                                     for b in CHECKPOINT_BACKENDS])
def test_shrink_to_one_process(workdir: Path, backend: str) -> None:
    """4 steps at 2 processes under ``backend``, then 4 at 1 process (backend single) == 8 straight at 2. (The
    recipe decays matrices only: under ZeRO-3, whose parameters are partitioned when the optimizer is built, the
    checkpoint once held 1 param group and one process, with 2, refused it.)"""
    straight = _straight_run(workdir, backend)
    run = resumed_copy(straight, f"{backend}-to-1", "--num-processes", "1", "--accelerate-config", "cpu")
    _assert_continues(run, straight, backend, 2, "single", 1)


# fsdp1 and fsdp2 in make test-all (CI time): a 1-process checkpoint read onto a sharded layout is zero3's here, and
# the portable state loaded into FSDP2 shards is test_change_of_backend's (and the LoRA single -> fsdp2 case's)
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.extended) if b != "zero3" else b
                                     for b in ("fsdp1", "fsdp2", "zero3")])
def test_grow_from_one_process(workdir: Path, reference: Path, backend: str) -> None:
    """4 steps at 1 process, then 4 at 2 processes under ``backend`` == 8 straight at 1 process."""
    run = resumed_copy(reference, f"1-to-{backend}", "--num-processes", "2", "--accelerate-config", backend)
    _assert_continues(run, reference, "single", 1, backend, 2)


def test_change_of_backend(workdir: Path) -> None:
    """ZeRO-3 partitions at 2 processes continue as FSDP2 shards at 2 processes."""
    straight = _straight_run(workdir, "zero3")
    run = resumed_copy(straight, "zero3-to-fsdp2", "--accelerate-config", "fsdp2")
    _assert_continues(run, straight, "zero3", 2, "fsdp2", 2)


def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "adapter_model.safetensors"))


# zero3 -> single in make test-all (CI time): a ZeRO-3 checkpoint read onto one process is test_shrink_to_one_process's
# and LoRA under ZeRO-3 test_lora_parity_complete_adapter_and_reload's; single -> fsdp2 runs the adapter's portable path
@pytest.mark.parametrize(("saved", "now"), [pytest.param("zero3", "single", marks=pytest.mark.extended),
                                            ("single", "fsdp2")])
def test_lora_changes_layout(workdir: Path, lora_reference: Path, saved: str, now: str) -> None:
    """A LoRA run (adapter-only checkpoint under single, the PEFT model's full sharded state under ZeRO-3) resumed on
    another layout: the same losses and the same final adapter as the run that never stopped."""
    straight = lora_reference if saved == "single" else lora_run(workdir, saved)
    layout = ("--num-processes", "1", "--accelerate-config", "cpu") if now == "single" else \
        ("--num-processes", "2", "--accelerate-config", now)
    run = resumed_copy(straight, f"lora-{saved}-to-{now}", *layout)
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == list(range(1, 9))
    assert _losses(run) == pytest.approx(_losses(straight), rel=TOL)
    adapter, expected = _adapter(run), _adapter(straight)
    assert adapter and adapter.keys() == expected.keys() and max_rel_diff(expected, adapter) <= TOL
    assert "resharded from" in (run / "train.log").read_text()


@pytest.mark.parametrize(("backend", "pattern"), [("zero2", "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                                  ("fsdp2", "optimizer_0/.metadata")])
def test_a_payload_never_runs_on_the_portable_path(workdir: Path, backend: str, pattern: str) -> None:
    """A payload planted in a sharded checkpoint (the manifest fixed up as an attacker would) does not run when the
    checkpoint is read into another layout either: the 1-process resume fails with one line, the run unchanged."""
    run = workdir / f"payload-portable-{backend}"
    marker = workdir / f"PWNED-{run.name}"
    copy_with_payload(_straight_run(workdir, backend), run, pattern, marker)
    before = (run / "metrics.jsonl").read_text()
    done = _finetune("resume", str(run), "--from", "step-000004", "--num-processes", "1", "--accelerate-config", "cpu",
                     "--trust-remote-code")
    assert not marker.exists(), f"the payload in {pattern} ran"
    assert done.returncode == 2 and "cannot be loaded" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert (run / "metrics.jsonl").read_text() == before
    assert not rundir.reshard_scratch(run).exists()


_READ = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from finetune.artifacts.portable import read_full_state
run = Path(sys.argv[1])
final = load_file(str(run / "final" / "model.safetensors"))
ckpt = run / "checkpoints" / "step-000008"
alone = read_full_state(ckpt, optimizer=False)
full = read_full_state(ckpt, scratch=run.parent / (run.name + "-read.tmp"))
print(json.dumps({
    "alone_optimizer": alone.optimizer is None,
    "keys": sorted(alone.model) == sorted(final) == sorted(full.model),
    "model_equal": all(torch.equal(alone.model[k].to(v.dtype), v) and torch.equal(full.model[k].to(v.dtype), v)
                       for k, v in final.items()),
    "steps": sorted({float(s["step"]) for s in full.optimizer["state"].values()}),
    "moments": sorted({k for s in full.optimizer["state"].values() for k in s}),
    "groups": [len(g["params"]) for g in full.optimizer["param_groups"]],
}))
"""


# zero3_offload in make test-all (CI time): its checkpoint files have zero3's layout, read in make test
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.extended) if b == "zero3_offload" else b
                                     for b in BACKENDS])
def test_read_full_state_of_every_backend(workdir: Path, backend: str) -> None:
    """One process, no process group, reads a 2-process checkpoint of every backend whole: its model equals the
    exported weights of that step exactly, with and without the optimizer, which holds AdamW's state of step 8
    for every trainable parameter in the recipe's two param groups: the 9 matrices that decay and the 3 norm weights
    that do not (the first decoder layer is frozen), whatever the backend (ZeRO-3, whose parameters are partitioned
    when the optimizer is built, once wrote one group of all 12). ZeRO-1 (bf16 here) records no frozen parameters
    for zero_to_fp32 (DeepSpeed writes frozen_param_shapes from ZeRO-2 on): its frozen first layer, once missing
    from the portable state, comes from the model states file, the bf16 values the run trained with and exported."""
    import subprocess
    import sys

    from tests.distributed.test_backends import _env

    run = _straight_run(workdir, backend)
    done = subprocess.run([sys.executable, "-c", _READ, str(run)], env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts == {"alone_optimizer": True, "keys": True, "model_equal": True, "steps": [8.0],
                     "moments": ["exp_avg", "exp_avg_sq", "step"], "groups": [9, 3]}
    scratch = run.parent / (run.name + "-read.tmp")
    assert scratch.exists() is backend.startswith("zero")  # DeepSpeed's optimizer goes through the converter
    shutil.rmtree(scratch, ignore_errors=True)
