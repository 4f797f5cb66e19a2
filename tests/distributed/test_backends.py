"""Every backend on 2 CPU processes over gloo gives the 1-process numbers, resumes exactly, and counts eval once.

Each run goes through the real CLI (`finetune run ... --accelerate-config X --num-processes 2`, which execs
`accelerate launch`). Every rank reports what really ran (tests/distributed/dist_hooks.py): 2 processes, the
expected distributed type, and sharded parameters where the backend shards them, because a wrong set-up on CPU
silently trains two independent jobs or plain DDP. Exports are read here, in a process that did not train.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from finetune.runtime.launch import free_port
from finetune.storage.metrics import read_metrics
from tests.distributed.conftest import made_once, session_folder
from tests.distributed.paths import side_file
from tests.integration.conftest import DATA, final_weights, max_rel_diff, tiny_recipe
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
EVAL_ROWS = 37  # not divisible by 2 ranks x eval batch 8
EXPECTED = {  # backend -> (distributed type, shards parameters)
    "ddp": ("DistributedType.MULTI_CPU", False),
    "fsdp1": ("DistributedType.FSDP", True),
    "fsdp2": ("DistributedType.FSDP", True),
    "zero1": ("DistributedType.DEEPSPEED", False),
    "zero2": ("DistributedType.DEEPSPEED", False),
    "zero3": ("DistributedType.DEEPSPEED", True),
    "zero3_offload": ("DistributedType.DEEPSPEED", True),
}
BACKENDS = list(EXPECTED)
# zero1 and zero3_offload write the checkpoint files of zero2 and zero3 through the same engine save/load (their
# straight runs are checked by test_parity_with_one_process): resuming, LoRA and changes of layout under them would
# repeat zero2's and zero3's checks, and CI time is tight
CHECKPOINT_BACKENDS = [backend for backend in BACKENDS if backend not in ("zero1", "zero3_offload")]
# the straight runs that train in bf16 mixed precision (DeepSpeed's own: bf16 weights and compute, fp32 master
# partition), each against the 1-process bf16 run (autocast over fp32 weights). zero1 stands for ZeRO-1/2 (the same
# stage_1_and_2 engine code; zero2 keeps the fp32 parity, and its checkpoints feed the resume and elastic tests at
# 1e-5) and zero3_offload for ZeRO-3 (zero3 keeps the fp32 parity that caught the partitioned weight-decay groups).
# DDP's bf16 parity is the killed run's (test_a_dead_rank_fails_the_job_quickly); FSDP's is in
# tests/distributed/test_fsdp_precision.py. No launch is added for them.
BF16 = ("zero1", "zero3_offload")
# DeepSpeed bf16 rounds every weight to bf16 and computes the whole forward in bf16 (norms and residual stream too),
# where the 1-process run keeps fp32 weights and autocast computes only matmuls in bf16; both keep fp32 masters
# that the optimizer updates. Losses differ by bf16's rounding (2^-8 = 3.9e-3 relative per element) averaged over
# a loss of ~1,000 tokens: measured 2.1e-4 (zero1 and zero3_offload) over 8 steps, eval loss 2.4e-5. Weights
# differ more: AdamW moves every element by about lr whatever the size of its gradient, so an element whose
# gradient is near zero moves on bf16 noise (up to 8 steps x lr 1e-3 against weights of at most ~0.1), and the
# frozen first layer is rounded to bf16 by the engine: measured 1.8e-2 (zero1 and zero3_offload).
BF16_REL, BF16_WEIGHTS = 1e-3, 5e-2
MEMORY_HOOKS = "tests.distributed.dist_hooks,tests.distributed.memory_hooks"
# the upper bound of plan / measured peak where a tiny-scale effect puts a backend over 1.15 (measured 1.16, 1.16
# and 1.18; the reason is in test_plan_is_within_15_percent_of_the_measured_peak)
UPPER = {"fsdp1": 1.25, "fsdp2": 1.25, "zero2": 1.25}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO),
            "FINETUNE_HOOKS": "tests.distributed.dist_hooks", **extra}


def _finetune(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune", *args], env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The recipe every run here trains, with the settings real runs use: pretrained weights from a folder (which
    ZeRO-3 builds partitioned at birth), weight decay, clipping (the grad norm is about 2-3), cosine with warmup,
    and a frozen part (the first decoder layer, through the row of tests/plugins/llama_parts.py). Any decision
    taken from a parameter's shape that a backend's partitioning fools (ZeRO-3 once put every matrix in the
    no-decay group) moves the losses and weights well past the 1e-4 the parity tests allow. One folder for the
    session's xdist workers (tests/distributed/conftest.py): test_elastic.py reads the runs trained here."""
    root = session_folder(tmp_path_factory, "dist")
    made_once(root / "recipe.yaml", lambda: _write_workdir(root))
    return root


def _write_workdir(root: Path) -> None:
    import transformers

    from finetune.registry import SUPPORTED_MODELS
    from finetune.runtime.modeling import ASSETS

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SUPPORTED_MODELS["llama"].tiny_config)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "pretrained")
    transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(root / "pretrained")
    lines = (DATA / "reverse_eval.jsonl").read_text().splitlines()[:EVAL_ROWS]
    (root / "eval.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tiny_recipe(
        model={"type": "llama-parts", "plugin": "tests.plugins.llama_parts", "path": str(root / "pretrained"),
               "freeze": ["layer0"]},
        optim={"lr": 1.0e-3, "weight_decay": 0.5},
        scheduler={"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
        data={"eval": str(root / "eval.jsonl")},
        train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 8, "max_grad_norm": 1.0},
        eval={"metrics": ["exact_match", "token_accuracy"], "batch_size": 8, "max_new_tokens": 6},
        checkpoint={"every_steps": 4, "keep_last": 3},
    )
    write_recipe_file(root / "recipe.yaml", recipe)


def _run(workdir: Path, name: str, *args: str, **env: str) -> tuple[Path, subprocess.CompletedProcess]:
    run = workdir / name
    done = _finetune("run", str(workdir / "recipe.yaml"), "-o", str(run), "--overwrite", *args, **env)
    return run, done


def _run_once(workdir: Path, name: str, *args: str, **env: str) -> Path:
    """``workdir/name`` trained (with ``args``) once per session, whichever xdist worker asks first; must succeed."""

    def make() -> None:
        done = _run(workdir, name, *args, **env)[1]
        assert done.returncode == 0, done.stderr[-3000:]

    return made_once(workdir / name, make)


def run_ok(workdir: Path, name: str, *args: str) -> Path:
    """``workdir/recipe.yaml`` trained into ``workdir/name`` (with ``args``), which must succeed; the run dir."""
    run, done = _run(workdir, name, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def reference(workdir: Path) -> Path:
    """The 1-process run with the same global batch (micro 4 x accum 2)."""
    return _run_once(workdir, "single")


@pytest.fixture(scope="module")
def reference_bf16(workdir: Path) -> Path:
    """The 1-process run in bf16 mixed precision (autocast over fp32 weights), for the bf16 runs."""
    return _run_once(workdir, "single-bf16", "train.mixed_precision=bf16")


_straight: dict[str, Path] = {}


def _straight_run(workdir: Path, backend: str) -> Path:
    """The straight 8-step run under ``backend`` (bf16 for the backends of BF16), trained once per session, with
    each rank's peak of live tensor bytes per step measured (tests/distributed/memory_hooks.py)."""
    if backend not in _straight:
        bf16 = ["train.mixed_precision=bf16"] if backend in BF16 else []
        _straight[backend] = _run_once(workdir, backend, "--accelerate-config", backend, "--num-processes", "2", *bf16,
                                       FINETUNE_HOOKS=MEMORY_HOOKS)
    return _straight[backend]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def _assert_really_distributed(run: Path, backend: str, reference: Path) -> None:
    distributed_type, shards = EXPECTED[backend]
    total = sum(t.numel() for t in final_weights(reference).values())
    for rank in (0, 1):
        facts = json.loads(side_file(run, f"rank-{rank}.json").read_text())
        assert facts["num_processes"] == 2 and facts["rank"] == rank
        assert facts["distributed_type"] == distributed_type and facts["backend"] == backend
        if shards:
            assert facts["local_param_numel"] < 0.75 * total, facts
        else:
            assert facts["local_param_numel"] == total, facts


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_with_one_process(workdir: Path, reference: Path, reference_bf16: Path, backend: str) -> None:
    """Per-step losses over 8 steps and exported weights match the 1-process run within 1e-4 (relative); the bf16
    runs (BF16) match the 1-process bf16 run, losses and eval loss within BF16_REL, the exported weights (DeepSpeed's
    fp32 masters: a bf16 engine exported its bf16 copy before) within BF16_WEIGHTS. Each step counts the 1-process
    run's input tokens and FLOPs per token: the tokens of both ranks summed in the step's one reduce, and the whole
    sizes of parameters a backend shards or partitions (ZeRO-3's hold an empty tensor in place)."""
    run = _straight_run(workdir, backend)
    _assert_really_distributed(run, backend, reference)
    bf16 = backend in BF16
    ref, rel = (reference_bf16, BF16_REL) if bf16 else (reference, 1e-4)
    assert _losses(run) == pytest.approx(_losses(ref), rel=rel)
    assert len(_losses(run)) == 8
    counted = [[(r["tokens"], r["flops_per_token"]) for r in read_metrics(x) if r["kind"] == "train"]
               for x in (run, ref)]
    assert counted[0] == counted[1]
    exported = final_weights(run)
    assert {str(t.dtype) for t in exported.values()} == {"torch.float32"}  # the fp32 master weights, not bf16
    assert max_rel_diff(final_weights(ref), exported) <= (BF16_WEIGHTS if bf16 else 1e-4)
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert evals[-1]["eval_samples"] == EVAL_ROWS == evals[-1]["eval_exact_match_total"]
    ref_eval = [r for r in read_metrics(ref) if r["kind"] == "eval"][-1]
    if not bf16:  # bf16 rounding may flip an argmax
        assert evals[-1]["eval_token_accuracy_total"] == ref_eval["eval_token_accuracy_total"]
    assert evals[-1]["eval_loss"] == pytest.approx(ref_eval["eval_loss"], rel=rel)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_is_within_15_percent_of_the_measured_peak(workdir: Path, backend: str) -> None:
    """``finetune plan`` for the run's resolved recipe (its backend, 2 processes) against each rank's peak of live
    tensor bytes over steps 3-8 of the straight run (tests/distributed/memory_hooks.py, no code shared with the
    plan; step 2 only learns which storages a step touches). The data rows are shorter than ``data.max_seq_len``
    and batches are padded to their longest row, so the plan is made at the longest padded length those steps
    trained (``data.max_seq_len`` = that length: the plan assumes full rows). Offloaded states are host memory in
    the plan and the same CPU memory here, so the plan's host total counts too.

    Measured ratios (plan / peak, equal on both ranks): ddp 1.11, fsdp1 1.16, fsdp2 1.16, zero1 (bf16) 1.00, zero2
    1.18, zero3 0.94, zero3_offload (bf16) 0.87 (fsdp2 was 1.10 while its sharded head, an FSDPLinear, took the
    loss's checkpointed path; it now takes the fused path as fsdp1's does, with fsdp1's peak and ratio). Before this
    test the plan missed ``model.freeze`` (ddp 1.25), DeepSpeed's reduce bucket (5e8 elements whatever the model:
    zero2 0.003, zero3 0.002; the worker now caps it at the trainable parameters and the plan counts it) and the
    partition ZeRO-3 keeps of a persistent parameter besides its whole data. Three backends are over 1.15 for a
    reason of this tiny scale, and are held to the stated bound of UPPER instead (fsdp2 with fsdp1, whose step it
    now matches): here the step's peak is the loss (its logits and softmax, two 0.4 MiB chunks of a
    512-token vocabulary, about the size of the whole model's states), which comes before any gradient exists (each
    rank runs one micro-step per step, and gradients are freed after every step); the plan adds what the step holds
    later: the gradients and ZeRO-1/2's reduce bucket (allocated at the first gradient: zero2, 1.04 without them)
    and FSDP1's two gathered decoder layers (the whole model here). For a real model those are small next to the
    activations that are still alive when they are allocated."""
    from finetune.config import load_recipe
    from finetune.runtime.plan import build_plan

    run = _straight_run(workdir, backend)
    ratios = {}
    for rank in (0, 1):
        steps = json.loads(side_file(run, f"memory-{rank}.json").read_text())["steps"]
        assert [s["step"] for s in steps] == list(range(2, 9))
        measured = max(s["peak"] for s in steps[1:])
        seq = max(s["seq"] for s in steps[1:])
        cfg = load_recipe(run / "recipe.resolved.yaml", [f"data.max_seq_len={seq}"])[0]
        plan = build_plan(cfg, devices=[])
        assert plan.sharding.backend == backend and plan.sharding.world == 2
        ratios[rank] = (plan.device_total + plan.host_total) / measured
    print(f"{backend}: plan / measured peak {ratios}")
    assert all(0.85 <= r <= UPPER.get(backend, 1.15) for r in ratios.values()), (backend, ratios)


PACKED_WEIGHTS = 5e-4  # see test_packed_parity_with_one_process


# the sharded ones (DDP packs as one process does); zero3 in make test-all (CI time): packing is the same collator,
# positions and token-count reduce under any backend, checked sharded by fsdp2, and ZeRO-3's FLOPs per token (its
# partitioned parameter sizes) by test_parity_with_one_process[zero3]
@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("zero3", marks=pytest.mark.extended)])
def test_packed_parity_with_one_process(workdir: Path, reference: Path, backend: str) -> None:
    """data.packing on 2 processes takes the steps of the padded 1-process run: per-step losses within 1e-4 and
    exported weights within PACKED_WEIGHTS (only the layout of each micro-batch and the reduction order change).

    Why the weights get 5e-4: a few elements of this tiny model have gradients that are rounding noise (e.g.
    ``layers.1.mlp.down_proj[13, 62]`` on a near-dead intermediate unit), which AdamW divides by a near-zero second
    moment, so any change of summation order moves them: the loss that finishes its gradients in forward
    moved that element by 2.4e-4 in the one-process run alone, and fsdp2 packed reached 1.86e-4 against the padded
    run (5 of 139,584 weights beyond 1e-5 relative, every other one within 7.5e-7)."""
    run, done = _run(workdir, f"{backend}-packed", "data.packing=true", "--accelerate-config", backend,
                     "--num-processes", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_really_distributed(run, backend, reference)
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-4)
    assert max_rel_diff(final_weights(reference), final_weights(run)) <= PACKED_WEIGHTS
    tokens = [[r["tokens"] for r in read_metrics(x) if r["kind"] == "train"] for x in (run, reference)]
    assert tokens[0] == tokens[1]
    # the same samples per step: the input tokens and squared lengths summed over both ranks (in the step's one
    # reduce) and the whole (unpartitioned) parameter sizes give the 1-process run's FLOPs per token
    per_token = [[r["flops_per_token"] for r in read_metrics(x) if r["kind"] == "train"] for x in (run, reference)]
    assert per_token[0] == pytest.approx(per_token[1], rel=1e-9)


def test_exports_load_with_from_pretrained(workdir: Path) -> None:
    """The exports of the sharded backends load in a fresh process with transformers."""
    import transformers

    for backend in ("fsdp1", "fsdp2", "zero3"):
        run = _straight_run(workdir, backend)
        model = transformers.AutoModelForCausalLM.from_pretrained(run / "final")
        loaded = model.state_dict()
        exported = final_weights(run)
        assert all(torch.equal(loaded[k], v) for k, v in exported.items())


def resumed_copy(source: Path, name: str, *args: str) -> Path:
    """A copy of the finished run ``source`` resumed from its step-4 checkpoint with ``args``; must succeed."""
    run = source.parent / name
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(source, run)
    done = _finetune("resume", str(run), "--from", "step-000004", "--trust-remote-code", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    return run


# ddp in make test-all (CI time): test_resume_across_world_sizes resumes on 2 DDP processes in make test
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.extended) if b == "ddp" else b
                                     for b in CHECKPOINT_BACKENDS])
def test_resume_equals_straight(workdir: Path, backend: str) -> None:
    """A run resumed from its step-4 checkpoint ends with the straight run's bit-identical weights (gloo's 2-rank
    sums are order-independent and CPU kernels deterministic). Under fsdp2 the checkpoint is the one a SIGTERM on
    rank 0 after step 3 makes every rank write after step 4; the others resume a copy of the straight run's own
    step-4 checkpoint (the stop on a signal is the same collective save whatever the backend: it is also checked
    under zero3 in test_vlm.py and on one process in tests/integration/test_resume.py), to save CI time."""
    straight = _straight_run(workdir, backend)
    if backend != "fsdp2":
        run = resumed_copy(straight, f"{backend}-resumed")
    else:
        run, done = _run(workdir, f"{backend}-resumed", "--accelerate-config", backend, "--num-processes", "2",
                         FINETUNE_TERM_AT_STEP="3")
        assert done.returncode != 0
        assert (run / "checkpoints" / "step-000004").is_dir() and not (run / "final").exists()
        resumed = _finetune("resume", str(run), "--trust-remote-code")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    manifest = json.loads((run / "checkpoints" / "step-000004" / "manifest.json").read_text())
    assert manifest["backend"] == backend and manifest["world_size"] == 2
    assert "resharded" not in (run / "train.log").read_text()  # the backend's own load
    a, b = final_weights(straight), final_weights(run)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == list(range(1, 9))


def test_resume_across_world_sizes(workdir: Path, reference: Path) -> None:
    """A 1-process checkpoint continues on 2 DDP processes with the same global sample order; a ZeRO checkpoint
    (per-rank shards) that records no parameter names (one written before finetune resharded checkpoints) is
    refused on another world size with one clear line (tests/distributed/test_elastic.py resumes those that do)."""
    run, done = _run(workdir, "grow", FINETUNE_TERM_AT_STEP="3")
    assert done.returncode == 143, done.stderr[-2000:]
    resumed = _finetune("resume", str(run), "--accelerate-config", "ddp", "--num-processes", "2", "--trust-remote-code")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-4)
    assert max_rel_diff(final_weights(reference), final_weights(run)) <= 1e-4
    assert "resume: layout launch.num_processes: 1 -> 2" in (run / "train.log").read_text()

    import shutil

    from finetune.storage import rundir

    left = workdir / "zero2-resumed"  # left by test_resume_equals_straight[zero2]
    if not left.is_dir():
        pytest.skip("needs test_resume_equals_straight[zero2]")
    zero = workdir / "zero2-old"
    shutil.rmtree(zero, ignore_errors=True)
    shutil.copytree(left, zero)
    ckpt = zero / "checkpoints" / "step-000004"
    (ckpt / "param_names.json").unlink()  # as a checkpoint from before param names; its manifest fixed up
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = rundir.inventory(ckpt)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    refused = _finetune("resume", str(zero), "--from", "step-000004", "--accelerate-config", "cpu",
                        "--num-processes", "1", "--allow-config-change", "--trust-remote-code")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "written by 2 process(es) under zero2" in refused.stderr and "Traceback" not in refused.stderr
    assert f"finetune export {zero} --from step-000004 -o DIR" in refused.stderr
    assert len([line for line in refused.stderr.splitlines() if line.startswith("error:")]) == 1


def test_a_dead_rank_fails_the_job_quickly(workdir: Path, reference_bf16: Path) -> None:
    """SIGKILL of rank 1 after step 5: the launcher exits non-zero within 60 s; the step-4 checkpoint stays whole.
    The run trains in bf16 (DDP: autocast over fp32 weights, fp32 all-reduce), so its steps before the kill are
    also DDP's bf16 parity: each rank computes the same 4-row micro-batches in the same precision as the 1-process
    bf16 run's micro-steps, only the gradient sums are ordered differently, so the losses of steps 1-5 match it
    within 1e-4, as the fp32 runs do (measured: equal)."""
    from finetune.storage.checkpoints import inspect

    run, done = _run(workdir, "killed", "--accelerate-config", "ddp", "--num-processes", "2",
                     "train.mixed_precision=bf16", FINETUNE_KILL_RANK="1:5")
    ended = time.time()
    assert done.returncode != 0
    assert ended - float(side_file(run, "killed-at").read_text()) < 60
    assert inspect(run / "checkpoints" / "step-000004").resumable
    assert not (run / "final").exists()
    logged = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert [r["step"] for r in logged][:5] == [1, 2, 3, 4, 5]  # rank 0 logs step 5 before rank 1 dies after it
    assert [r["loss"] for r in logged][:5] == pytest.approx(_losses(reference_bf16)[:5], rel=1e-4)


# --- LoRA under every backend -------------------------------------------------------------------------------------

LORA = ["peft.method=lora", "peft.dropout=0"]  # no adapter dropout: rank RNG streams would differ from 1 process


@pytest.fixture(scope="module")
def lora_reference(workdir: Path) -> Path:
    return _run_once(workdir, "lora-single", *LORA)


_lora: dict[str, Path] = {}


def lora_run(workdir: Path, backend: str) -> Path:
    """The LoRA run on 2 processes under ``backend`` (checkpoints at steps 4 and 8), trained once per session."""
    if backend not in _lora:
        _lora[backend] = _run_once(workdir, f"lora-{backend}", "--accelerate-config", backend, "--num-processes", "2",
                                   *LORA)
    return _lora[backend]


# ddp: LoRA on 2 DDP processes is matched with one process by tests/distributed/test_load_once.py
# zero2 in make test-all (CI time): its layout is checked by the full-weight parity and resume runs; fsdp2 too: LoRA
# under FSDP2 trains steps 5-8 and saves its adapter, complete and equal to the 1-process one, in
# test_elastic.py::test_lora_changes_layout[single-fsdp2], and the eval of a reloaded sharded adapter is fsdp1's and
# zero3's here
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.extended) if b in ("zero2", "fsdp2") else b
                                     for b in CHECKPOINT_BACKENDS if b != "ddp"])
def test_lora_parity_complete_adapter_and_reload(workdir: Path, lora_reference: Path, backend: str) -> None:
    """LoRA on 2 processes: per-step losses equal the 1-process LoRA run within 1e-4; the saved adapter is complete
    (FSDP1 naively saves an empty one) and equal to the 1-process adapter; reloading it gives the live eval loss."""
    from safetensors.torch import load_file

    run = lora_run(workdir, backend)
    assert json.loads(side_file(run, "rank-1.json").read_text())["distributed_type"] == EXPECTED[backend][0]
    assert _losses(run) == pytest.approx(_losses(lora_reference), rel=1e-4)
    adapter = load_file(str(run / "final" / "adapter_model.safetensors"))
    reference = load_file(str(lora_reference / "final" / "adapter_model.safetensors"))
    assert adapter and adapter.keys() == reference.keys()
    assert max_rel_diff(reference, adapter) <= 1e-4
    shown = _finetune("eval", str(run), "--json", "--trust-remote-code")
    assert shown.returncode == 0, shown.stderr[-2000:]
    live = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]
    assert json.loads(shown.stdout)["eval_loss"] == pytest.approx(live["eval_loss"], rel=1e-5)


def test_worker_refuses_a_world_size_the_recipe_did_not_plan(reference: Path) -> None:
    """A resolved recipe for 1 process launched on 2 would silently double the global batch: refused."""
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(REPO / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "--main_process_port",
         str(free_port()), "-m", "finetune.runtime.worker",
         str(reference / "recipe.resolved.yaml"), "--allow-plugin"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode != 0
    assert "error: launch.num_processes=1 but 2 process(es) are running" in done.stderr


# --- safety under a launcher ---------------------------------------------------------------------------------------


def _ranks_alive(run: Path, launcher: int) -> list[int]:
    """Pids of processes (but the launcher) whose command line runs the worker on ``run``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "finetune.runtime.worker" in cmdline and str(run) in cmdline and int(proc.name) != launcher:
            pids.append(int(proc.name))
    return pids


def test_the_launcher_holds_the_lock_and_its_ranks_die_with_it(workdir: Path) -> None:
    """`finetune run` execs `accelerate launch`, which keeps the run's flock: while the 2 ranks train, resume and
    run --overwrite refuse with its pid. A SIGKILL of the launcher takes its ranks down too (they must not go on
    writing an unlocked run), and the run can then be resumed."""
    import signal

    run = workdir / "locked"
    live = subprocess.Popen([sys.executable, "-m", "finetune", "run", str(workdir / "recipe.yaml"), "-o", str(run),
                             "--accelerate-config", "ddp", "--num-processes", "2", "train.max_steps=100000",
                             "checkpoint.every_steps=2"], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        # any checkpoint: keep_last rotates step-000002 away within a poll interval on a fast machine
        while not [p for p in (run / "checkpoints").glob("step-*") if not p.name.endswith(".tmp")]:
            assert live.poll() is None and time.monotonic() < deadline, "the run ended before the test"
            time.sleep(0.2)
        for args in (["resume", str(run), "--trust-remote-code"],
                     ["run", str(workdir / "recipe.yaml"), "-o", str(run), "--overwrite"]):
            refused = _finetune(*args, timeout=120)
            assert refused.returncode == 2 and f"in use by pid {live.pid} " in refused.stderr, refused.stderr[-2000:]
        assert len(_ranks_alive(run, live.pid)) == 2
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    deadline = time.monotonic() + 30
    while _ranks_alive(run, live.pid):
        assert time.monotonic() < deadline, "ranks outlived their launcher"
        time.sleep(0.2)
    # the run can be resumed: the lock went with the launcher and no scratch holds anything but finetune's (what
    # resume checks before it loads; resuming a SIGKILLed run is test_resume.py's, in one process: CI time)
    from finetune.storage import rundir

    lock, _ = rundir.open_existing(run, "resume")
    lock.release()


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def copy_with_payload(source: Path, run: Path, pattern: str, marker: Path) -> None:
    """``source`` copied to ``run`` with the file ``pattern`` of its step-4 checkpoint replaced by a payload that
    would create ``marker`` if it were ever unpickled, and the manifest fixed up to match (as an attacker who can
    write the run dir would)."""
    import pickle
    import shutil

    from finetune.storage import rundir

    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(source, run)
    ckpt = run / "checkpoints" / "step-000004"
    target = ckpt / pattern
    assert target.is_file(), sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    if target.suffix == ".pt":
        torch.save(_Payload(marker), target)
    else:
        target.write_bytes(pickle.dumps(_Payload(marker), protocol=4))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = rundir.inventory(ckpt)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("backend", "pattern"), [  # one file of each format in make test, the rest in make test-all
    ("fsdp2", "pytorch_model_fsdp_0/.metadata"),
    pytest.param("fsdp2", "optimizer_0/__0_0.distcp", marks=pytest.mark.extended),
    pytest.param("zero2", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt", marks=pytest.mark.extended),
    ("zero3", "pytorch_model/zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_a_payload_in_a_sharded_checkpoint_never_runs(workdir: Path, backend: str, pattern: str) -> None:
    """The sharded formats' own files (DCP metadata and shards, DeepSpeed's torch.save files) with a payload, the
    manifest fixed up: the 2-process resume fails (DCP's metadata reader and torch.load are restricted), and
    nothing runs."""
    run = workdir / f"payload-{backend}-{Path(pattern).name}"
    marker = workdir / f"PWNED-{run.name}"
    copy_with_payload(_straight_run(workdir, backend), run, pattern, marker)
    done = _finetune("resume", str(run), "--from", "step-000004", "--trust-remote-code", timeout=300)
    assert not marker.exists(), f"the payload in {pattern} ran"
    assert done.returncode != 0
    assert "cannot be loaded" in done.stderr, done.stderr[-2000:]
