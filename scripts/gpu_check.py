"""``make gpu-check``: real ``finetune`` runs on this machine's GPUs, each row with its own time limit, one report.

One command on a lent GPU machine (``--budget``): ``python3 scripts/gpu_check.py --budget --out $OUT/gpu-check``.
Step 0 (the ``bundle`` row) installs the wheels of ``.whl/`` (what the machine's image lacks: pydantic, datasets and
their needs; ``scripts/device_bundle.py`` downloads them) with ``pip --no-index --no-deps --target`` when those
modules are not importable; every ``finetune`` command then runs from this checkout with that folder first on its
PYTHONPATH. The script prints the machine and the versions, then runs the rows, one ``finetune`` CLI process at a
time, on a Qwen2.5-0.5B-shaped model (Qwen2 architecture: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocabulary 151,936, tied embeddings, rope theta 1e6) built from a config with random weights and saved as a
bf16 folder, as a hub checkpoint is (no download). The bundled 512-token tokenizer feeds it: its ids are valid ids
of the larger vocabulary.

Rows (each a subprocess group with its own time limit: a hang or a slow compile fails one row, not the whole check):

- ``bundle``: the wheels installed offline (or nothing to install); ``model``: the model folder and the data;
- ``fp32 reference``: the plain path (fp32, sdpa, padded batches) for the first steps: the losses of the others;
- ``bf16 run``: fp32 master weights from the bf16 folder, bf16 autocast, sdpa, packing (flash-attn varlen kwargs),
  the chunked loss, gradient checkpointing, checkpoints, the final export and eval.
  Loss parity against the reference; input tokens/s per GPU and MFU from its step lines (after warm-up, leaving out
  the step after each checkpoint save); peak ``mem_alloc_gb`` of the step lines against ``finetune plan --json``;
- ``resume`` from the middle checkpoint (its losses repeat the straight run's), ``export --from`` that checkpoint
  (verified in a fresh process by the CLI), ``eval`` of the final export (its eval loss repeats the run's);
- ``lora``: bf16 weights (``model.dtype: bfloat16``) with a LoRA adapter, exported (and verified) at the end;
- ``flash-attn``: the bf16 run with ``flash_attention_2``, when flash-attn is importable;
- ``grpo``: a few GRPO steps on the reverse-letters prompts (exact_match reward); completion tokens/s;
- ``distill``: a few on-policy distillation steps, the saved model teaching a student of its first half of layers
  (full vocabulary, bf16); finite divergence, completion tokens/s, peak memory against ``finetune plan``;
- ``compile``: the bf16 run's first steps with ``train.compile`` (per block), last: a slow compile costs only it;
- ``fsdp2 xN`` and ``zero3 xN``: the bf16 run on every GPU, without ``--budget`` and with 2 or more GPUs.

``--budget`` sizes the check for a lease: one GPU (the multi-GPU rows are skipped), run folders in a temporary
folder (only the report, its JSON and the command log go to ``--out``), and a deadline for all rows
(``--deadline-s``, 570 s): a row never runs past it, so the report is written inside a 10-minute command.

``--dry-run`` runs exactly the same rows shrunk to a tiny Qwen2 (vocabulary 1,024 for the 512-token tokenizer) on
the CPU, skipping with one line each what cannot run there: torch.compile, flash-attn, the device's peak memory and
MFU; the bundle row installs ``.whl/`` (if there is one) into a temporary folder for the lent machine's Python and
checks it, without using it. ``tests/integration/test_gpu_check.py`` runs ``--budget --dry-run``, so the script
and the CLI calls it makes cannot rot.

What has run on a GPU: ``--budget`` on one H200 (torch 2.11, transformers 5.17, no flash-attn), every row passing;
docs/gpu-check/ keeps each report with its date and device. The flash-attn row and the multi-GPU rows have never
run.

Exit status: 0 when every row passed (or was skipped), 1 when any failed (the report says which), 2 for a usage
error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import platform
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "scripts") not in sys.path:  # its sibling device_bundle, also when loaded by path (the tests)
    sys.path.insert(0, str(ROOT / "scripts"))

import device_bundle  # noqa: E402  (the lent machine's Python and wheel platforms)

DATA = ROOT / "recipes" / "data"
TOKENIZER = ROOT / "finetune" / "assets" / "tiny-llama-tokenizer"

# Stated tolerances (relative). bf16 autocast over fp32 master weights rounds every matmul input to 8 mantissa bits
# (~0.4%); over the reference's steps the per-step loss tracks fp32 to well under 2%.
LOSS_RTOL = 2e-2
# A resume repeats the straight run: bit-identical on CPU; on a GPU, kernels with atomics (some attention
# backwards, some reductions) may differ in the last bits, which the following steps do not amplify past this.
RESUME_RTOL = 1e-3
# finetune eval of an export in a fresh process against the run's own final eval (same precision, same data).
EVAL_RTOL = 1e-2
# The plan is an estimate; the check fails when the measured peak exceeds it by more than this (an under-estimate
# is what makes a planned run go out of memory). max_memory_allocated excludes the CUDA context, as the plan does.
PLAN_SLACK = 1.25

BUNDLE = ROOT / ".whl"
BUNDLE_MODULES = ("pydantic", "datasets")  # what the lent machine's image lacks (the wheels carry their needs too)
# The lent machine's interpreter (CPython 3.12 on x86-64 Linux), as scripts/device_bundle.py downloads for it:
# --dry-run installs the bundle for it, whatever Python runs the dry run, so a wheel that would not install there
# fails here too.
LENT_PYTHON = ["--python-version", ".".join(map(str, device_bundle.PYTHON)), "--implementation", "cp",
               "--abi", "cp312", "--abi", "abi3", "--abi", "none",
               *(arg for platform in device_bundle.PLATFORMS for arg in ("--platform", platform)),
               "--platform", "linux_x86_64"]
BUDGET_DEADLINE_S = 570.0  # inside a 600 s command: the report is written before the command's limit
MIN_ROW_S = 10.0  # a row is not started with less time than this left before the deadline
LOG_TAIL = 6000  # characters of each command's output kept in commands.log (the full text stays in memory)

# Qwen2.5-0.5B's shape (its config.json on the hub), built with random weights: no download.
QWEN25_05B: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
}
# The same architecture for the CPU: twice the tokenizer's 512 ids, so a vocabulary larger than the tokenizer (and
# completions sampled beyond it, in GRPO) stays part of the dry run at little cost.
TINY_QWEN2: dict[str, Any] = {
    "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
}


@dataclass(frozen=True)
class Sizes:
    """How big each row is. The GPU sizes keep the whole ``--budget`` check near 8 minutes on one H100."""

    shape: dict[str, Any]
    max_seq_len: int
    lengths: tuple[int, int]  # sample lengths of the synthetic data, in tokens (approximately)
    train_rows: int
    eval_rows: int
    micro: int
    global_batch: int
    steps: int
    checkpoint_every: int
    warmup: int  # steps left out of tokens/s and MFU (compile, allocator warm-up)
    reference_steps: int  # the fp32 reference's steps, compared with the first steps of every run
    lora_steps: int
    grpo_steps: int
    grpo_group: int
    grpo_new_tokens: int
    compile: bool
    limits: dict[str, float]  # seconds per row (rows not named: "default")


GPU_SIZES = Sizes(
    shape=QWEN25_05B, max_seq_len=1024, lengths=(256, 1024), train_rows=600, eval_rows=32, micro=8, global_batch=16,
    steps=30, checkpoint_every=15, warmup=5, reference_steps=10, lora_steps=10, grpo_steps=4, grpo_group=8,
    grpo_new_tokens=64, compile=True,
    limits={"bundle": 120, "model": 120, "plan": 180, "fp32 reference": 180, "bf16 run": 330, "resume": 210,
            "export": 120, "eval": 90, "lora": 150, "flash-attn": 150, "grpo": 150, "distill": 150,
            "compile": 240,
            "default": 330})
CPU_SIZES = Sizes(
    shape=TINY_QWEN2, max_seq_len=64, lengths=(16, 64), train_rows=64, eval_rows=8, micro=4, global_batch=8,
    steps=6, checkpoint_every=3, warmup=1, reference_steps=4, lora_steps=3, grpo_steps=2, grpo_group=2,
    grpo_new_tokens=8, compile=False, limits={"default": 600})


@dataclass
class Result:
    """One row of the report: its checks (name, passed, detail), figures, and how long it ran against its limit."""

    row: str
    rule: str = ""
    status: str = "pass"  # pass | FAIL | skipped
    limit_s: float | None = None
    seconds: float | None = None
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append((name, ok, detail))
        if not ok:
            self.status = "FAIL"
        return ok


class RowTimeout(Exception):
    """A command ran into its row's time limit (it and everything it started were killed)."""


class NotRun(Exception):
    """A row cannot run because an earlier row it builds on failed (the message says which)."""


@dataclass
class Outcome:
    code: int | None  # None: killed at the time limit
    text: str
    seconds: float


class Runner:
    """Runs commands one at a time, each in a process group of its own that is killed (SIGKILL, every process in
    it: accelerate's ranks, DataLoader workers, inductor's compile workers) at its time limit, at Ctrl+C, and after
    it exits. Output goes to a temporary file (a pipe held open by a stray grandchild would block the read). Each
    command and the end of its output are appended to ``log``."""

    def __init__(self, log: Path, cwd: Path, env: dict[str, str]) -> None:
        self.log, self.cwd, self.env = log, cwd, env
        self.lock = threading.Lock()  # the plan runs in a thread beside the reference

    def __call__(self, argv: list[str], timeout: float, label: str | None = None) -> Outcome:
        started = time.perf_counter()
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as sink:
            proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            code: int | None = None
            try:
                code = proc.wait(timeout=max(timeout, 0.1))
            except subprocess.TimeoutExpired:
                pass
            finally:  # also on KeyboardInterrupt: nothing of the check outlives it
                _kill_group(proc)
            sink.seek(0)
            text = sink.read()
        seconds = time.perf_counter() - started
        ending = f"exit {code}" if code is not None else f"KILLED at its time limit ({timeout:.0f} s)"
        with self.lock, open(self.log, "a", encoding="utf-8") as f:
            f.write(f"$ {label or ' '.join(argv)}   # {ending}, {seconds:.1f} s\n"
                    f"{text[-LOG_TAIL:]}{'' if text.endswith(chr(10)) or not text else chr(10)}\n")
        return Outcome(code, text, seconds)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group ``proc`` leads (start_new_session), then reap ``proc``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Context:
    """What the rows share: the sizes, folders, the runner and what earlier rows produced."""

    sizes: Sizes
    dry: bool
    out: Path
    work: Path
    run: Runner
    env: dict[str, str]
    gpus: int  # GPUs the multi-GPU rows use (1 under --budget and --dry-run)
    peak_tflops: float | None = None
    site: Path | None = None  # where the bundle row installs
    deadline: float | None = None  # time.monotonic() at which every row must have ended
    row_deadline: float = math.inf
    notes: list[str] = field(default_factory=list)
    model_ready: bool = False
    reference: dict[int, float] | None = None
    plan_job: concurrent.futures.Future[Outcome] | None = None
    main_run: Path | None = None
    main_eval: dict[str, Any] | None = None

    def left(self) -> float:
        return self.row_deadline - time.monotonic()

    def command(self, argv: list[str], label: str | None = None) -> Outcome:
        """Run ``argv`` within what is left of the row's time; RowTimeout when it is killed there."""
        got = self.run(argv, self.left(), label)
        if got.code is None:
            raise RowTimeout(label or argv[0])
        return got

    def finetune(self, *args: str) -> Outcome:
        return self.command([sys.executable, "-m", "finetune", *args], "finetune " + " ".join(args))


@dataclass
class Row:
    """A row of the check: what it runs (``body``), its time limit, its pass rule, or why it is skipped."""

    name: str
    rule: str
    body: Callable[[Context, Result], None]
    skip: str | None = None


# --------------------------------------------------------------------------------------------------------------
# Figures from the step lines


def _metrics(run: Path) -> list[dict[str, Any]]:
    """The run's metrics rows (finetune's own reader); none where the run never wrote them."""
    from finetune.storage.metrics import read_metrics  # after the bundle row: it needs pydantic

    return read_metrics(run) if (run / "metrics.jsonl").exists() else []


def _train_rows(run: Path) -> list[dict[str, Any]]:
    return [r for r in _metrics(run) if r.get("kind") == "train"]


def _train_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _train_rows(run)}


def _final_eval(run: Path) -> dict[str, Any] | None:
    evals = [r for r in _metrics(run) if r.get("kind") == "eval" and "eval_loss" in r]
    return evals[-1] if evals else None


def _max_rel(a: dict[int, float], b: dict[int, float], steps: list[int]) -> float:
    """The largest relative difference of ``a`` from ``b`` over ``steps`` (inf when a step is missing or not
    finite: a missing loss never passes)."""
    worst = 0.0
    for s in steps:
        if s not in a or s not in b or not (math.isfinite(a[s]) and math.isfinite(b[s])):
            return math.inf
        worst = max(worst, abs(a[s] - b[s]) / max(abs(b[s]), 1e-12))
    return worst


def step_figures(rows: list[dict[str, Any]], warmup: int, checkpoint_every: int | None) -> dict[str, Any]:
    """Input tokens/s per device, MFU and peak memory from a run's train rows (one per step: ``logging.every_steps``
    1). A row's rates cover the time since the previous row, so the timed steps are those after ``warmup`` and not
    right after a checkpoint save (the save's time falls into the next step). Tokens/s and MFU are time-weighted
    over the timed steps; the peak is the largest ``mem_alloc_gb`` (CUDA only: None elsewhere, never a guess)."""
    rows = sorted(rows, key=lambda r: r["step"])
    seconds = tokens = flops = 0.0
    with_mfu = True
    for prev, row in itertools.pairwise(rows):
        step = row["step"]
        saved = bool(checkpoint_every) and prev["step"] % checkpoint_every == 0  # type: ignore[operator]
        if step <= warmup or step != prev["step"] + 1 or saved:
            continue
        dt = row["elapsed_s"] - prev["elapsed_s"]
        if dt <= 0:
            continue
        seconds += dt
        tokens += row.get("tokens_per_s", 0.0) * dt
        if row.get("mfu") is None:
            with_mfu = False
        else:
            flops += row["mfu"] * dt
    peaks = [r["mem_alloc_gb"] for r in rows if r.get("mem_alloc_gb") is not None]
    return {"tokens_per_s_per_device": tokens / seconds if seconds else None,
            "mfu": flops / seconds if seconds and with_mfu else None,
            "timed_steps_s": round(seconds, 3),
            "peak_bytes": max(peaks) * 1e9 if peaks else None}


def completion_figures(rows: list[dict[str, Any]], completions_per_step: int) -> dict[str, Any]:
    """GRPO's completion tokens per second: ``completion_len`` (mean completion tokens) x completions per step over
    each step's time, leaving out the first step (warm-up). A step's time also holds its policy update, so this is
    a lower bound on the generation speed."""
    rows = sorted(rows, key=lambda r: r["step"])
    seconds = tokens = 0.0
    for prev, row in itertools.pairwise(rows):
        if row["step"] == prev["step"] + 1 and row.get("completion_len") is not None:
            seconds += row["elapsed_s"] - prev["elapsed_s"]
            tokens += row["completion_len"] * completions_per_step
    lens = [r["completion_len"] for r in rows if r.get("completion_len") is not None]
    return {"completion_tokens_per_s": tokens / seconds if seconds > 0 else None,
            "completion_len": sum(lens) / len(lens) if lens else None,
            "truncated": rows[-1].get("truncated") if rows else None}


# --------------------------------------------------------------------------------------------------------------
# The bundle


def missing_modules(modules: tuple[str, ...] = BUNDLE_MODULES) -> list[str]:
    """The modules of ``modules`` this interpreter cannot import (found without importing them)."""
    importlib.invalidate_caches()
    return [m for m in modules if importlib.util.find_spec(m) is None]


def install_bundle(run: Runner, wheels: list[Path], target: Path, timeout: float, *,
                   for_lent_machine: bool = False) -> Outcome:
    """``pip install --no-index --no-deps --target`` of exactly these wheels: offline, nothing resolved or fetched
    (the wheels carry every need). ``for_lent_machine``: for the lent machine's CPython 3.12 on x86-64 Linux rather
    than this interpreter (--dry-run)."""
    argv = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target),
            *(LENT_PYTHON if for_lent_machine else []), *map(str, wheels)]
    return run(argv, timeout, f"pip install --no-index --no-deps --target {target} "
                              f"{'(for CPython 3.12 x86-64) ' if for_lent_machine else ''}{len(wheels)} wheels")


def bundle_row(ctx: Context, res: Result) -> None:
    wheels = sorted(BUNDLE.glob("*.whl")) if BUNDLE.is_dir() else []
    if ctx.dry:
        if not wheels:
            res.status, res.note = "skipped", "no .whl/ here (CI has none): the install is checked where it exists"
            return
        target = ctx.work / "site"
        got = install_bundle(ctx.run, wheels, target, ctx.left(), for_lent_machine=True)
        if got.code is None:
            raise RowTimeout("pip install")
        absent = [m for m in BUNDLE_MODULES if not (target / m / "__init__.py").is_file()]
        res.check("install", got.code == 0 and not absent,
                  f"{len(wheels)} wheels for CPython 3.12 into a temporary folder; this dry run keeps its own packages"
                  if got.code == 0 and not absent else
                  f"exit {got.code}: {got.text.strip()[-400:]}" if got.code else
                  f"installed, but {', '.join(absent)} not among them")
        return
    missing = missing_modules()
    if not missing:
        res.status, res.note = "skipped", f"{', '.join(BUNDLE_MODULES)} importable: nothing to install"
        return
    if not wheels:
        res.check("install", False, f"{', '.join(missing)} not importable and no wheels in {BUNDLE}: run "
                  "scripts/device_bundle.py on a machine with pip access and carry .whl")
        return
    assert ctx.site is not None
    got = install_bundle(ctx.run, wheels, ctx.site, ctx.left())
    if got.code is None:
        raise RowTimeout("pip install")
    if not res.check("install", got.code == 0, f"{len(wheels)} wheels into {ctx.site}" if got.code == 0 else
                     f"exit {got.code}: {got.text.strip()[-400:]}"):
        return
    use_site(ctx, ctx.site)
    probe = ctx.command([sys.executable, "-c", f"import {', '.join(BUNDLE_MODULES)}"], "import " + ", ".join(missing))
    res.check("import", probe.code == 0, f"{', '.join(missing)} import from {ctx.site}" if probe.code == 0 else
              probe.text.strip()[-400:])


def use_site(ctx: Context, site: Path) -> None:
    """Put the installed bundle first on this process's path (versions in the header) and on every command's."""
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    ctx.env["PYTHONPATH"] = os.pathsep.join([str(site), ctx.env["PYTHONPATH"]])


# --------------------------------------------------------------------------------------------------------------
# The model, the data and the recipes


def save_model(folder: Path, shape: dict[str, Any]) -> int:
    """A Qwen2 model of ``shape`` with seeded random weights, saved in bf16 (as hub checkpoints are) with the bundled
    tokenizer, so the rows load it from ``model.path`` as they would a hub checkpoint; built on the GPU when there
    is one (initialising 0.5B parameters on the CPU takes longer than the save). Returns the parameter count."""
    import torch
    import transformers

    from finetune.backends import unwrap_without_importing_deepspeed

    unwrap_without_importing_deepspeed()  # save_pretrained's unwrap would import DeepSpeed: ~3 s of CPU
    config = transformers.Qwen2Config(**shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, folder / f.name)
    return sum(p.numel() for p in model.parameters())


def write_data(folder: Path, sizes: Sizes) -> tuple[Path, Path]:
    """Synthetic completion rows of ``sizes.lengths`` tokens (about 11 tokens per reversal, ``"k d a : a d k."``):
    long enough to fill a GPU, learnable, seeded. Returns the train and eval files."""
    rng = random.Random(0)

    def text(tokens: int) -> str:
        parts = []
        for _ in range(max(1, tokens // 11)):
            letters = [rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 5))]
            parts.append(f"{' '.join(letters)} : {' '.join(reversed(letters))}.")
        return " ".join(parts)

    files = []
    for name, rows in (("train", sizes.train_rows), ("eval", sizes.eval_rows)):
        path = folder / f"reverse_long_{name}.jsonl"
        path.write_text("".join(json.dumps({"text": text(rng.randint(*sizes.lengths))}) + "\n" for _ in range(rows)))
        files.append(path)
    return files[0], files[1]


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` applied section by section (a nested dict merges, anything else replaces)."""
    merged = dict(base)
    for key, value in changes.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def recipe(ctx: Context, name: str, changes: dict[str, Any]) -> Path:
    """The bf16 run's recipe with ``changes``, written (as JSON, which is YAML) to the work folder."""
    s = ctx.sizes
    base = {
        "name": name,
        "model": {"type": "qwen2", "path": str(ctx.work / "model"), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"format": "completion", "train": str(ctx.work / "reverse_long_train.jsonl"),
                 "eval": str(ctx.work / "reverse_long_eval.jsonl"), "max_seq_len": s.max_seq_len, "packing": True},
        "train": {"seed": 7, "micro_batch_size": s.micro, "global_batch_size": s.global_batch, "max_steps": s.steps,
                  "mixed_precision": "bf16", "gradient_checkpointing": True, "compile": False,
                  "peak_tflops": ctx.peak_tflops},
        "optim": {"name": "adamw", "lr": 2e-4},
        # constant after the warm-up: a run of any length takes the reference's learning rates over its steps
        "scheduler": {"name": "constant", "warmup_steps": 2},
        "eval": {"every_steps": None, "metrics": ["token_accuracy"], "batch_size": s.micro * 2},
        "checkpoint": {"every_steps": s.checkpoint_every, "keep_last": 3, "save_final": True},
        "logging": {"every_steps": 1, "progress": False},
    }
    path = ctx.work / f"{name}.yaml"
    path.write_text(json.dumps(_merge(base, changes), indent=1))
    return path


def _launch(processes: int, backend: str) -> list[str]:
    return ["--accelerate-config", backend, "--num-processes", str(processes)] if processes > 1 else []


def _needs_model(ctx: Context) -> None:
    if not ctx.model_ready:
        raise NotRun("the model row failed")


def _ran(res: Result, got: Outcome, what: str) -> bool:
    return res.check("run", got.code == 0, what if got.code == 0 else f"exit {got.code}: {got.text.strip()[-600:]}")


# --------------------------------------------------------------------------------------------------------------
# The rows


def model_row(ctx: Context, res: Result) -> None:
    write_data(ctx.work, ctx.sizes)
    got = ctx.command([sys.executable, str(Path(__file__).resolve()), "--save-model", str(ctx.work / "model"),
                       "--shape", json.dumps(ctx.sizes.shape)], "save the model (gpu_check.py --save-model)")
    found = [line for line in got.text.splitlines() if line.startswith("{")]
    params = json.loads(found[-1])["parameters"] if got.code == 0 and found else None
    shape = ctx.sizes.shape
    ctx.model_ready = res.check(
        "saved", params is not None,
        f"Qwen2, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, vocabulary "
        f"{shape['vocab_size']:,}: {params / 1e6:,.1f}M parameters in bf16" if params else
        f"exit {got.code}: {got.text.strip()[-600:]}")
    res.figures["parameters"] = params


def reference_row(ctx: Context, res: Result) -> None:
    _needs_model(ctx)
    s = ctx.sizes
    path = recipe(ctx, "fp32-reference", {
        "data": {"packing": False, "eval": None}, "eval": {"metrics": []},
        "train": {"max_steps": s.reference_steps, "mixed_precision": "no", "gradient_checkpointing": False,
                  "compile": False},
        "checkpoint": {"every_steps": None, "save_final": False}})
    ctx.plan_job = _start_plan(ctx)  # CPU work beside the reference (no GPU), ready before the bf16 run
    run = ctx.work / "runs" / "fp32-reference"
    got = ctx.finetune("run", str(path), "-o", str(run), "--overwrite")
    if _ran(res, got, f"{s.reference_steps} steps, fp32 weights and compute, padded batches"):
        losses = _train_losses(run)
        finite = len(losses) == s.reference_steps and all(math.isfinite(v) for v in losses.values())
        if res.check("losses", finite, f"{len(losses)} finite losses, {losses.get(1, math.nan):.4f} -> "
                     f"{losses.get(s.reference_steps, math.nan):.4f}"):
            ctx.reference = losses


def _start_plan(ctx: Context) -> concurrent.futures.Future[Outcome]:
    """``finetune plan --json`` of the bf16 run's recipe, in a thread (it runs on the CPU, on the meta device)."""
    path = recipe(ctx, "bf16-run", {})
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    job = pool.submit(ctx.run, [sys.executable, "-m", "finetune", "plan", str(path), "--json"],
                      _limit(ctx, "plan"), f"finetune plan {path} --json")
    pool.shutdown(wait=False)
    return job


def _parity(ctx: Context, res: Result, losses: dict[int, float], label: str = "loss parity") -> None:
    if ctx.reference is None:
        res.check(label, False, "the fp32 reference run failed")
        return
    steps = list(range(1, ctx.sizes.reference_steps + 1))
    worst = _max_rel(losses, ctx.reference, steps)
    res.check(label, worst <= LOSS_RTOL, f"max |loss - fp32| / fp32 over steps 1-{steps[-1]} = {worst:.2e} "
              f"(tolerance {LOSS_RTOL:g})")


def _plan(got: Outcome | None) -> dict[str, Any] | None:
    found = [line for line in got.text.splitlines() if line.startswith("{")] if got and got.code == 0 else []
    return json.loads(found[0]) if found else None


def _train_checks(ctx: Context, res: Result, path: Path, run: Path, plan: dict[str, Any] | None,
                  launch: list[str]) -> bool:
    """Run a training recipe; check loss parity, take the step-line figures, check peak memory against ``plan``."""
    s = ctx.sizes
    got = ctx.finetune("run", str(path), "-o", str(run), "--overwrite", *launch)
    if not _ran(res, got, f"{s.steps} steps"):
        return False
    _parity(ctx, res, _train_losses(run))
    figures = step_figures(_train_rows(run), s.warmup, s.checkpoint_every)
    res.figures.update(figures)
    res.figures["plan_bytes"] = plan["device_total_bytes"] if plan else None
    res.check("step lines", (figures["tokens_per_s_per_device"] or 0) > 0,
              f"tokens/s over {figures['timed_steps_s']:.1f} s of steps {s.warmup + 1}-{s.steps} (without the step "
              f"after a checkpoint save)")
    if figures["peak_bytes"] is None:
        res.note = "peak memory n/a (no CUDA device)"
    elif plan:
        ratio = figures["peak_bytes"] / plan["device_total_bytes"]
        res.check("peak memory vs plan", ratio <= PLAN_SLACK,
                  f"measured/plan = {ratio:.2f} (fails above {PLAN_SLACK:g})")
    return True


def main_row(ctx: Context, res: Result) -> None:
    _needs_model(ctx)
    got = ctx.plan_job.result() if ctx.plan_job else None
    plan = _plan(got)
    res.check("plan", plan is not None, "finetune plan --json" if plan else
              f"{'no plan' if got is None else got.code}: {got.text.strip()[-300:] if got else ''}")
    run = ctx.work / "runs" / "bf16-run"
    if _train_checks(ctx, res, recipe(ctx, "bf16-run", {}), run, plan, []):
        ctx.main_run, ctx.main_eval = run, _final_eval(run)
        res.check("final eval", ctx.main_eval is not None, "logged" if ctx.main_eval else "no eval row")


def _mid(ctx: Context) -> str:
    if ctx.main_run is None:
        raise NotRun("the bf16 run failed")
    return f"step-{ctx.sizes.checkpoint_every:06d}"


def resume_row(ctx: Context, res: Result) -> None:
    mid, run, s = _mid(ctx), ctx.main_run, ctx.sizes
    assert run is not None
    straight = _train_losses(run)
    got = ctx.finetune("resume", str(run), "--from", mid)
    if not res.check("resume", got.code == 0, f"--from {mid}" if got.code == 0 else
                     f"exit {got.code}: {got.text.strip()[-600:]}"):
        return
    later = list(range(s.checkpoint_every + 1, s.steps + 1))
    worst = _max_rel(_train_losses(run), straight, later)
    res.check("resume parity", worst <= RESUME_RTOL, f"max relative loss difference, steps {later[0]}-{later[-1]} = "
              f"{worst:.2e} (tolerance {RESUME_RTOL:g})")
    again = _final_eval(run)
    if ctx.main_eval and again:
        rel = abs(again["eval_loss"] - ctx.main_eval["eval_loss"]) / ctx.main_eval["eval_loss"]
        res.check("final eval", rel <= EVAL_RTOL, f"eval_loss {again['eval_loss']:.5f} vs the straight run's "
                  f"{ctx.main_eval['eval_loss']:.5f}: {rel:.1e} (tolerance {EVAL_RTOL:g})")
    else:
        res.check("final eval", False, "no eval row after the resume")


def export_row(ctx: Context, res: Result) -> None:
    mid, run = _mid(ctx), ctx.main_run
    assert run is not None
    got = ctx.finetune("export", str(run), "--from", mid, "-o", str(ctx.work / "exports" / mid), "--overwrite")
    res.check("export", got.code == 0, f"{mid}, reloaded and verified in a fresh process by finetune export"
              if got.code == 0 else f"exit {got.code}: {got.text.strip()[-600:]}")


def eval_row(ctx: Context, res: Result) -> None:
    _mid(ctx)
    assert ctx.main_run is not None
    logged = _final_eval(ctx.main_run)  # the resumed run's, when the resume row ran: the one final/ comes from
    got = ctx.finetune("eval", str(ctx.main_run / "final"), "--json")
    found = [line for line in got.text.splitlines() if line.startswith("{")]
    if not res.check("eval", got.code == 0 and bool(found) and logged is not None,
                     "final/ in a fresh process" if got.code == 0 else f"exit {got.code}: {got.text.strip()[-600:]}"):
        return
    assert logged is not None
    value = json.loads(found[0])["eval_loss"]
    rel = abs(value - logged["eval_loss"]) / logged["eval_loss"]
    res.figures["eval_loss"] = value
    res.check("export parity", rel <= EVAL_RTOL, f"eval_loss {value:.5f} vs the run's {logged['eval_loss']:.5f}: "
              f"{rel:.1e} (tolerance {EVAL_RTOL:g})")


def lora_row(ctx: Context, res: Result) -> None:
    _needs_model(ctx)
    s = ctx.sizes
    path = recipe(ctx, "lora", {
        "model": {"dtype": "bfloat16"}, "train": {"max_steps": s.lora_steps, "compile": False},
        "optim": {"lr": 1e-3}, "checkpoint": {"every_steps": None},
        "peft": {"method": "lora", "preset": "attn_mlp", "r": 16, "alpha": 32}})
    run = ctx.work / "runs" / "lora"
    got = ctx.finetune("run", str(path), "-o", str(run), "--overwrite")
    if not _ran(res, got, f"{s.lora_steps} steps on bf16 weights; the adapter exported and verified by the run"):
        return
    losses = _train_losses(run)
    if ctx.reference is None:
        res.check("step-1 parity", False, "the fp32 reference run failed")
    else:  # LoRA's B starts at zero: the first step's model is the base model
        worst = _max_rel(losses, ctx.reference, [1])
        res.check("step-1 parity", worst <= LOSS_RTOL, f"step 1 against the fp32 reference (B = 0: the base model): "
                  f"{worst:.2e} (tolerance {LOSS_RTOL:g})")
    first, last = losses.get(1, math.nan), losses.get(s.lora_steps, math.nan)
    res.check("learns", last < first, f"loss {first:.4f} -> {last:.4f}")
    res.check("adapter", (run / "final" / "adapter_config.json").is_file(), "final/adapter_config.json")
    res.figures.update(step_figures(_train_rows(run), min(s.warmup, s.lora_steps - 2), None))


def flash_row(ctx: Context, res: Result) -> None:
    _needs_model(ctx)
    s = ctx.sizes
    path = recipe(ctx, "flash-attn", {
        "model": {"attn_implementation": "flash_attention_2"}, "data": {"eval": None}, "eval": {"metrics": []},
        "train": {"max_steps": s.reference_steps, "compile": False},
        "checkpoint": {"every_steps": None, "save_final": False}})
    run = ctx.work / "runs" / "flash-attn"
    got = ctx.finetune("run", str(path), "-o", str(run), "--overwrite")
    if _ran(res, got, f"{s.reference_steps} steps, packed rows through flash-attn's varlen kernel"):
        _parity(ctx, res, _train_losses(run))
        res.figures.update(step_figures(_train_rows(run), min(s.warmup, s.reference_steps - 2), None))


def grpo_row(ctx: Context, res: Result) -> None:
    _needs_model(ctx)
    s = ctx.sizes
    path = recipe(ctx, "grpo", {
        "task": "grpo",
        "data": {"format": "prompt", "train": str(DATA / "reverse_prompts_train.jsonl"), "eval": None,
                 "packing": False, "max_seq_len": 64 + s.grpo_new_tokens},
        "eval": {"metrics": []},
        "train": {"max_steps": s.grpo_steps, "micro_batch_size": s.micro, "global_batch_size": s.micro,
                  "gradient_checkpointing": False, "compile": False},
        "optim": {"lr": 1e-5}, "scheduler": {"warmup_steps": 0},
        "checkpoint": {"every_steps": None, "save_final": False},
        "grpo": {"group_size": s.grpo_group, "max_new_tokens": s.grpo_new_tokens, "rewards": [{"exact_match": True}]}})
    run = ctx.work / "runs" / "grpo"
    got = ctx.finetune("run", str(path), "-o", str(run), "--overwrite")
    completions = s.micro * s.grpo_group
    if not _ran(res, got, f"{s.grpo_steps} steps of {completions} completions of up to {s.grpo_new_tokens} tokens"):
        return
    rows = _train_rows(run)
    figures = completion_figures(rows, completions)
    res.figures.update(figures)
    res.check("generation", len(rows) == s.grpo_steps and (figures["completion_tokens_per_s"] or 0) > 0,
              f"{len(rows)} step lines with completion_len; completion tokens/s over steps 2-{s.grpo_steps}")


def distill_row(ctx: Context, res: Result) -> None:
    """On-policy distillation at the full vocabulary: the saved model is the teacher (bf16 folder, whole on the
    GPU), the student its first half of the layers (loaded from the same folder with fewer layers: a truncated
    student), reverse KL on completions the student samples from the reverse-letters prompts; the chunked divergence
    of both heads under bf16 autocast, the teacher's forward, and peak memory against ``finetune plan``."""
    _needs_model(ctx)
    s = ctx.sizes
    layers = max(1, s.shape["num_hidden_layers"] // 2)
    path = recipe(ctx, "distill", {
        "task": "distill",
        "model": {"config_overrides": {"num_hidden_layers": layers}},
        "data": {"format": "alpaca", "train": str(DATA / "reverse_train.jsonl"), "eval": None, "packing": False,
                 "max_seq_len": 64 + s.grpo_new_tokens},
        "eval": {"metrics": []},
        "train": {"max_steps": s.grpo_steps, "micro_batch_size": s.micro, "global_batch_size": s.micro,
                  "gradient_checkpointing": False, "compile": False},
        "optim": {"lr": 1e-5}, "scheduler": {"warmup_steps": 0},
        "checkpoint": {"every_steps": None, "save_final": False},
        "distill": {"teacher": str(ctx.work / "model"), "mode": "on_policy", "loss": "reverse_kl",
                    "max_new_tokens": s.grpo_new_tokens}})
    plan = _plan(ctx.finetune("plan", str(path), "--json"))
    res.check("plan", plan is not None, "finetune plan --json (the teacher counted)" if plan else "no plan")
    run = ctx.work / "runs" / "distill"
    got = ctx.finetune("run", str(path), "-o", str(run), "--overwrite")
    if not _ran(res, got, f"{s.grpo_steps} on-policy steps of {s.micro} completions of up to {s.grpo_new_tokens} "
                          f"tokens, a {layers}-layer student of the saved model"):
        return
    rows = _train_rows(run)
    figures = completion_figures(rows, s.micro)
    peaks = [r["mem_alloc_gb"] for r in rows if r.get("mem_alloc_gb") is not None]
    figures.update(peak_bytes=max(peaks) * 1e9 if peaks else None, plan_bytes=plan["device_total_bytes"] if plan
                   else None)
    res.figures.update(figures)
    finite = all(math.isfinite(r.get("divergence", math.nan)) and r.get("teacher_logprob") is not None
                 for r in rows)
    res.check("divergence", len(rows) == s.grpo_steps and finite,
              f"{len(rows)} step lines with a finite divergence and the teacher's log-prob")
    if figures["peak_bytes"] is None:
        res.note = "peak memory n/a (no CUDA device)"
    elif plan:
        ratio = figures["peak_bytes"] / plan["device_total_bytes"]
        res.check("peak memory vs plan", ratio <= PLAN_SLACK, f"measured/plan = {ratio:.2f} (fails above "
                                                               f"{PLAN_SLACK:g})")


def compile_row(ctx: Context, res: Result) -> None:
    _needs_model(ctx)
    s = ctx.sizes
    steps = s.reference_steps
    path = recipe(ctx, "compile", {
        "data": {"eval": None}, "eval": {"metrics": []}, "train": {"max_steps": steps, "compile": True},
        "checkpoint": {"every_steps": None, "save_final": False}})
    run = ctx.work / "runs" / "compile"
    got = ctx.finetune("run", str(path), "-o", str(run), "--overwrite")
    if _ran(res, got, f"{steps} steps of the bf16 run with train.compile (each block compiled)"):
        _parity(ctx, res, _train_losses(run))
        res.figures.update(step_figures(_train_rows(run), min(s.warmup, steps - 2), None))


def multi_gpu_row(backend: str) -> Callable[[Context, Result], None]:
    def body(ctx: Context, res: Result) -> None:
        _needs_model(ctx)
        name = f"{backend}-x{ctx.gpus}"
        path = recipe(ctx, name, {"train": {"compile": ctx.sizes.compile and backend != "zero3"}})
        launch = _launch(ctx.gpus, backend)
        got = ctx.finetune("plan", str(path), *launch, "--json")
        plan = _plan(got)
        res.check("plan", plan is not None, "finetune plan --json" if plan else f"exit {got.code}")
        _train_checks(ctx, res, path, ctx.work / "runs" / name, plan, launch)
    return body


def rows(ctx: Context, budget: bool, flash: str | None) -> list[Row]:
    """The rows in the order they run, with their pass rules."""
    multi = ("--budget: one GPU" if budget else "--dry-run runs one CPU process" if ctx.dry else
             f"needs 2+ GPUs, found {ctx.gpus}" if ctx.gpus < 2 else None)
    n = max(ctx.gpus, 2)
    return [
        Row("bundle", "pydantic and datasets import (installed offline from .whl/ when missing)", bundle_row),
        Row("model", "the model folder is saved", model_row),
        Row("fp32 reference", "runs; every loss finite", reference_row),
        Row("bf16 run", f"plan; runs; loss within {LOSS_RTOL:g} of fp32; tokens/s > 0; peak <= {PLAN_SLACK:g} x plan",
            main_row),
        Row("resume", f"resumes; losses within {RESUME_RTOL:g}; final eval within {EVAL_RTOL:g}", resume_row),
        Row("export", "exports the middle checkpoint, verified in a fresh process", export_row),
        Row("eval", f"eval of final/ within {EVAL_RTOL:g} of the run's", eval_row),
        Row("lora", f"runs; step 1 within {LOSS_RTOL:g} of fp32; loss falls; adapter exported", lora_row),
        Row("flash-attn", f"runs; loss within {LOSS_RTOL:g} of fp32", flash_row, skip=flash),
        Row("grpo", "runs; completion tokens/s > 0", grpo_row),
        Row("distill", f"plan; runs; finite divergence; peak <= {PLAN_SLACK:g} x plan", distill_row),
        # last: a slow or failing compile costs this row alone
        Row("compile", f"runs; loss within {LOSS_RTOL:g} of fp32; tokens/s > 0", compile_row,
            skip=None if ctx.sizes.compile else "--dry-run: inductor on the CPU costs the suite minutes"),
        Row(f"fsdp2 x{n}", f"plan; runs; loss within {LOSS_RTOL:g} of fp32; peak <= {PLAN_SLACK:g} x plan",
            multi_gpu_row("fsdp2"), skip=multi),
        Row(f"zero3 x{n}", f"plan; runs; loss within {LOSS_RTOL:g} of fp32; peak <= {PLAN_SLACK:g} x plan",
            multi_gpu_row("zero3"), skip=multi),
    ]


def _limit(ctx: Context, name: str) -> float:
    """A row's own limit, cut to what is left before the deadline."""
    limit = float(ctx.sizes.limits.get(name, ctx.sizes.limits["default"]))
    if ctx.deadline is not None:
        limit = min(limit, ctx.deadline - time.monotonic())
    return limit


def run_rows(ctx: Context, table: list[Row]) -> Iterator[Result]:
    """Run each row within its own time limit (and the deadline); a row that fails, times out or breaks fails alone
    and the next one runs."""
    for row in table:
        res = Result(row.name, rule=row.rule)
        if row.skip:
            res.status, res.note = "skipped", row.skip
            print(f"gpu-check: {row.name}: skipped ({row.skip})", flush=True)
            yield res
            continue
        limit = _limit(ctx, row.name)
        res.limit_s = round(limit, 1)
        if limit < MIN_ROW_S:
            res.check("time", False, f"not started: {max(limit, 0):.0f} s were left before the deadline")
            yield res
            continue
        print(f"gpu-check: {row.name} (limit {limit:.0f} s) ...", flush=True)
        started = time.monotonic()
        ctx.row_deadline = started + limit
        try:
            row.body(ctx, res)
        except RowTimeout as exc:
            res.check("time", False, f"timed out after {limit:.0f} s (in {exc}); killed with everything it started")
        except NotRun as exc:
            res.check("needs", False, f"not run: {exc}")
        except Exception as exc:  # a broken row is one FAIL line, and the rest of the check still runs
            res.check("error", False, f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        res.seconds = round(time.monotonic() - started, 1)
        print(f"gpu-check: {row.name}: {res.status} in {res.seconds:.1f} s", flush=True)
        yield res


# --------------------------------------------------------------------------------------------------------------
# Machine, report, command line



def machine(dry: bool, budget: bool) -> dict[str, Any]:
    """The machine and the versions, for the header and the report (nothing here initialises CUDA)."""
    import torch

    from finetune.version import installed  # the installed version, without importing the package

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        gpus = [line.strip() for line in smi.stdout.splitlines() if line.strip()] if smi.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        gpus = []
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "python": platform.python_version(),
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "mode": ("--dry-run (CPU)" if dry else "GPU") + (", --budget" if budget else ""),
        "gpus (nvidia-smi: name, driver, memory)": gpus or "none", "cuda (torch built with)": torch.version.cuda,
    }
    for name in ("torch", "transformers", "accelerate", "peft", "datasets", "pydantic", "flash-attn", "deepspeed",
                 "wandb"):
        info[name] = installed(name) or "not installed"
    return info


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if key.endswith("bytes"):
        return f"{value / 2**30:,.2f} GiB"
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


FIGURE_NAMES = {"tokens_per_s_per_device": "input tok/s per GPU", "mfu": "MFU", "peak_bytes": "peak",
                "plan_bytes": "plan", "completion_tokens_per_s": "completion tok/s", "completion_len": "completion len",
                "parameters": "parameters", "eval_loss": "eval_loss", "truncated": "truncated"}


def report(info: dict[str, Any], results: list[Result], notes: list[str], command: str) -> str:
    ok = all(r.status != "FAIL" for r in results)
    lines = [f"# finetune GPU check: {'PASS' if ok else 'FAIL'}", "", f"Written by `{command}`.", "",
             "## Machine", ""] + [f"- {k}: {v}" for k, v in info.items()] + [""]
    lines += ["## Rows", "", "| row | status | seconds / limit | figures | pass rule |", "|---|---|---|---|---|"]
    for r in results:
        figures = "; ".join(f"{FIGURE_NAMES[k]} {_fmt(k, v)}" for k, v in r.figures.items() if k in FIGURE_NAMES)
        took = f"{_fmt('', r.seconds)} / {_fmt('', r.limit_s)}" if r.limit_s is not None else ""
        lines.append(f"| {r.row} | {r.status}{': ' + r.note if r.note else ''} | {took} | {figures} | {r.rule} |")
    lines += ["", "## Checks", ""]
    for r in results:
        for name, passed, detail in r.checks:
            lines.append(f"- {r.row}: {name}: {'pass' if passed else 'FAIL'} ({detail})")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def out_problem(out: Path, flag: str = "--out") -> str | None:
    """Why ``out`` cannot be the check's folder (one line naming it and the fix), or None: it must be a folder or
    not exist yet, and not a symbolic link (the check writes its runs, logs and report there, never through a
    link)."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{flag} {out}: cannot be used ({exc.strerror}); give a folder for the check's runs and report"
    if stat.S_ISDIR(mode):
        return None
    what = "a symbolic link" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else "not a folder"
    return f"{flag} {out} is {what}; give a folder for the check's runs and report (a new one, or an earlier check's)"


def _notes(sizes: Sizes, dry: bool, flash: str | None, deadline: float | None) -> list[str]:
    notes = [f"Loss parity: each step's loss against the fp32 reference over its {sizes.reference_steps} steps "
             f"(a constant learning rate after 2 warm-up steps, so runs of any length share them), relative "
             f"tolerance {LOSS_RTOL:g}; resume parity {RESUME_RTOL:g}; export eval parity {EVAL_RTOL:g}; peak memory "
             f"fails above {PLAN_SLACK:g} x the plan.",
             "Tokens/s and MFU are the step lines' (metrics.jsonl: input tokens, padding left out; MFU by "
             "finetune.runtime.flops against the dense bf16 peak table, gradient-checkpointing recompute not "
             "counted), time-weighted over the steps after warm-up that do not follow a checkpoint save. GRPO's "
             "completion tokens/s divide by the whole step time (generation and update): a lower bound."]
    if deadline is not None:
        notes.append(f"Deadline: every row ends within {deadline:.0f} s of the start; each row has its own limit "
                     "inside it.")
    if dry:
        notes += ["Nothing in this report ran on a GPU: --dry-run trains a tiny Qwen2 on the CPU.",
                  "torch.compile skipped: on the CPU, inductor failed on the bf16 + packing model (torch 2.13) and its "
                  "compile would cost the suite minutes; the GPU rows compile.",
                  "Peak device memory and MFU are n/a on the CPU (no device allocator, no peak FLOPs)."]
    if flash:
        notes.append(f"flash-attn skipped: {flash}.")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", action="store_true",
                        help="a lent machine: install .whl/ if needed, one GPU, run folders in a temporary folder, "
                             "every row within --deadline-s")
    parser.add_argument("--dry-run", action="store_true", help="the same rows shrunk to a tiny model on the CPU")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="folder for the report")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the models, runs and exports (default: <out>/work; with --budget a "
                             "temporary folder, removed at the end)")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"),
                        help="where the bundle row installs .whl/ when pydantic or datasets is missing")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help=f"seconds every row must end within (default with --budget on a GPU: "
                             f"{BUDGET_DEADLINE_S:g}; else none)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak, when the table does not know it (or to override it)")
    parser.add_argument("--save-model", type=Path, default=None, help=argparse.SUPPRESS)  # the model row's child
    parser.add_argument("--shape", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if str(ROOT) not in sys.path:  # finetune runs from this checkout (the lent machine has it installed nowhere)
        sys.path.append(str(ROOT))
    if args.save_model is not None:
        print(json.dumps({"parameters": save_model(args.save_model, args.shape)}))
        return 0
    for path, flag in ((args.out, "--out"), (args.work, "--work")):
        if path is not None and (problem := out_problem(path, flag)):  # before any work
            print(f"error: {problem}", file=sys.stderr)
            return 2
    import torch

    gpus = torch.cuda.device_count()
    if not args.dry_run and gpus == 0:
        print("error: no CUDA GPU found (torch.cuda.device_count() == 0; a CPU-only torch?); install a CUDA torch "
              "first (see the Makefile), or run `scripts/gpu_check.py --dry-run` for the CPU check", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "commands.log").write_text("")
    temporary = args.work is None and args.budget
    work = Path(tempfile.mkdtemp(prefix="gpu-check-")) if temporary else (args.work or out / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    deadline_s = args.deadline_s if args.deadline_s is not None else (
        BUDGET_DEADLINE_S if args.budget and not args.dry_run else None)
    used = 1 if args.budget or args.dry_run else gpus
    base = CPU_SIZES if args.dry_run else GPU_SIZES
    # every run takes the same global batch: a multiple of the multi-GPU rows' micro-batches x processes
    step = base.micro * max(used, 2)
    sizes = replace(base, global_batch=-(-base.global_batch // step) * step)
    # FINETUNE_DEBUG: a failing command leaves its traceback in commands.log, where the report's reader needs it
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FINETUNE_DEBUG": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    ctx = Context(sizes=sizes, dry=args.dry_run, out=out, work=work, run=Runner(out / "commands.log", work, env),
                  env=env, gpus=used, peak_tflops=args.peak_tflops, site=args.site.resolve(),
                  deadline=time.monotonic() + deadline_s if deadline_s is not None else None)
    flash = ("--dry-run runs on the CPU, and flash-attn needs CUDA" if args.dry_run else
             None if importlib.util.find_spec("flash_attn") else "flash-attn is not installed (the rows use sdpa)")
    table = rows(ctx, args.budget, flash)
    try:
        results = [next(run_rows(ctx, table[:1]))]  # the bundle first: the header shows what it installed
        info = machine(args.dry_run, args.budget)
        print("gpu-check: " + "; ".join(f"{k} {v}" for k, v in info.items()), flush=True)
        results += list(run_rows(ctx, table[1:]))
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    notes = _notes(sizes, args.dry_run, flash, deadline_s)
    command = "scripts/gpu_check.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    text = report(info, results, notes, command)
    (out / "gpu-check-report.md").write_text(text)
    (out / "gpu-check-report.json").write_text(json.dumps(
        {"machine": info, "notes": notes, "results": [asdict(r) for r in results]}, indent=1, default=str))
    print(text)
    return 0 if all(r.status != "FAIL" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
