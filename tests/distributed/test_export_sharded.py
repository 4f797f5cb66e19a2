"""`finetune export` and `finetune eval` of checkpoints that 2 processes wrote in a sharded layout (FSDP2's DCP
shards, ZeRO-3 partitions), read back in ONE process on the CPU without a process group.

The straight 2-process runs of tests/distributed/test_backends.py are reused (its `_straight_run` and `workdir`),
so CI trains them once: 8 steps, checkpoints at steps 4 and 8, and the run's own final/ export at step 8, gathered
by the backend itself on rank 0. The export of the step-8 checkpoint must hold the same weights within 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from finetune.storage.metrics import read_metrics
from tests.distributed.test_backends import _finetune, _straight_run, workdir  # noqa: F401  (workdir: a fixture)

pytestmark = [pytest.mark.distributed, pytest.mark.extended]  # make test-all, not make test (CI time)
SHARDED = ["fsdp2", "zero3"]


@pytest.mark.parametrize("backend", SHARDED)
def test_export_of_a_sharded_checkpoint_equals_the_runs_own_export(workdir: Path, backend: str) -> None:  # noqa: F811
    run = _straight_run(workdir, backend)
    out = workdir / f"export-{backend}"
    done = _finetune("export", str(run), "-o", str(out), "--overwrite", "--trust-remote-code")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported step-000008 (step 8)" in done.stdout and "logits match the recorded probe" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["layout"]["backend"] == backend and manifest["source"]["layout"]["world_size"] == 2
    exported, final = load_file(str(out / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert exported.keys() == final.keys()
    worst = max(float((exported[k].float() - final[k].float()).abs().max()) for k in final)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("backend", SHARDED)
def test_eval_and_ls_of_a_sharded_checkpoint(workdir: Path, backend: str) -> None:  # noqa: F811
    """`finetune eval` of the step-8 checkpoint (one process, through its export in a scratch folder, verified
    against the logits the 2 ranks recorded) gives the eval the 2-process run logged at step 8 (the same samples,
    the loss within 1e-4 as in test_backends' parity); `finetune ls` shows each checkpoint's layout."""
    run = _straight_run(workdir, backend)
    shown = _finetune("eval", str(run / "checkpoints" / "step-000008"), "--json", "--trust-remote-code")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "verified: the export reproduces the recorded logits" in shown.stderr
    got = json.loads(shown.stdout)
    logged = next(r for r in read_metrics(run) if r["kind"] == "eval" and r["step"] == 8)
    assert got["step"] == 8 and got["eval_samples"] == logged["eval_samples"]
    assert got["eval_token_accuracy_total"] == logged["eval_token_accuracy_total"]
    assert got["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-4)
    listing = _finetune("ls", str(run))
    assert listing.returncode == 0, listing.stderr
    line = next(line for line in listing.stdout.splitlines() if line.startswith("step-000004"))
    assert f"{backend} x2" in line
