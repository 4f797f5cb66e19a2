"""``make gpu-check``: a short matrix of real ``finetune`` runs on whatever GPUs this machine has, one report.

Rows: one GPU with bf16, flash-attn (when installed), packing and torch.compile on a Llama-like model built from a
config; the same on a small Qwen2-like model (the ``qwen2`` row, loaded from a folder this script saves); FSDP2 and
ZeRO-3 on every GPU when there are 2 or more. Each row drives the real CLI: ``finetune plan --json``, ``finetune run``
(periodic checkpoints, final export, final eval), ``finetune resume --from`` the middle checkpoint (its losses must
repeat the straight run's), ``finetune export --from`` that checkpoint (verified in a fresh process by the CLI) and
``finetune eval`` of the final export (its eval loss must repeat the run's). An fp32 single-process reference run of
each model gives the loss parity.

Measured per row: input tokens/s per GPU (non-padding tokens the model read, timed over steps without a checkpoint,
after warm-up), MFU (``finetune.runtime.flops``; omitted for a device the peak table does not know, or
``--peak-tflops``),
peak ``torch.cuda.max_memory_allocated`` against the plan's per-rank device total. A measurement hook (this module,
imported by the worker through ``FINETUNE_HOOKS``) records them at each step boundary; it changes nothing in training.

``--dry-run`` runs the same matrix shrunk to tiny models on the CPU in one process, skipping what needs GPUs (with a
line saying why): it proves the script, the CLI calls and the checks still work (tests/integration/test_gpu_check.py).
It trains one model there, the Qwen2-like one (loaded from a folder, as a hub checkpoint is), through every check;
the Llama-like recipe of the other rows is planned (``finetune plan`` validates it and builds it on the meta device)
but not trained: every step of the script is the same for both models, and each CPU run costs the test suite ~15 s
of CPU, mostly imports. Peak memory there is n/a: CPU runs have no device allocator to ask.

NOTHING HERE HAS RUN ON A GPU YET: the GPU path of this script is written against the CUDA APIs but unverified.

Exit status: 0 when every check passed, 1 when any failed (the report says which), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import itertools
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "recipes" / "data"
HOOK_ENV = "GPU_CHECK_MEASURE"  # folder the hook writes rank<N>.jsonl into; unset: the hook does nothing

# Stated tolerances (relative). bf16 autocast with fp32 master weights rounds every matmul input to 8 mantissa bits
# (~0.4%); over a few dozen steps of a small model the per-step loss tracks fp32 to well under 2%.
LOSS_RTOL = 2e-2
# A resume repeats the straight run: bit-identical on CPU; on a GPU, kernels with atomics (flash-attn's backward,
# some reductions) may differ in the last bits, which the following steps do not amplify past this.
RESUME_RTOL = 1e-3
# finetune eval of the export in a fresh process against the run's own final eval (same precision, same data).
EVAL_RTOL = 1e-2
# The plan is an estimate; the check fails when the measured peak exceeds it by more than this (an under-estimate
# is what makes a planned run go out of memory). max_memory_allocated excludes the CUDA context, as the plan does.
PLAN_SLACK = 1.25


# --------------------------------------------------------------------------------------------------------------
# The measurement hook (runs inside the worker on every rank)


class _Counter:
    """Counts the input tokens (non-padding) and the sum of squared sample lengths of every micro-batch the loop
    counts targets in (host tensors, before the forward: no device sync is added)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.squares = 0

    def add(self, batch: dict[str, Any]) -> None:
        ids = batch.get("input_ids")
        if ids is None:
            return
        mask, pos = batch.get("attention_mask"), batch.get("position_ids")
        for row in range(ids.shape[0]):
            if mask is not None:
                lens = [int(mask[row].sum())]
            elif pos is not None:  # packed: positions restart at 0 for every sample
                starts = [*(pos[row] == 0).nonzero().flatten().tolist(), int(pos.shape[1])]
                lens = [b - a for a, b in itertools.pairwise(starts)]
            else:
                lens = [int(ids.shape[1])]
            self.tokens += sum(lens)
            self.squares += sum(n * n for n in lens)


_COUNTER = _Counter()
_STATE: dict[str, Any] = {}


def _after_step(trainer: Any) -> None:
    import torch

    cuda = torch.cuda.is_available() and trainer.accelerator.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    now = time.perf_counter()
    if "path" not in _STATE:  # first step seen by this process: start counting from the next one
        task = trainer.task
        plain = task.count_targets

        def counted(batch: dict[str, Any]) -> int:
            _COUNTER.add(batch)
            return plain(batch)

        task.count_targets = counted
        rank = trainer.accelerator.process_index
        _STATE["path"] = Path(os.environ[HOOK_ENV]) / f"rank{rank}.jsonl"
    row = {"step": trainer.state.step, "t": now, "tokens": _COUNTER.tokens, "squares": _COUNTER.squares,
           "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "world": trainer.accelerator.num_processes}
    with open(_STATE["path"], "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ != "__main__" and os.environ.get(HOOK_ENV):
    from finetune import hooks

    hooks.register("after_step", lambda trainer, **_: _after_step(trainer))


# --------------------------------------------------------------------------------------------------------------
# The matrix


@dataclass
class Model:
    """A model of the matrix: its recipe ``model`` section and the reference run's name."""

    name: str
    section: dict[str, Any]


@dataclass
class Row:
    name: str
    model: Model
    accelerate_config: str = "cpu"
    processes: int = 1
    compile: bool = False
    skip: str | None = None
    train: bool = True  # False: `finetune plan` only (--dry-run's Llama row: see the module docstring)


@dataclass
class Sizes:
    steps: int
    checkpoint_every: int
    warmup: int  # steps left out of the throughput (compile, allocator warm-up)
    micro: int
    global_batch: int
    llama: dict[str, int]
    qwen2: dict[str, int]


GPU_SIZES = Sizes(steps=40, checkpoint_every=20, warmup=5, micro=32, global_batch=64,
                  llama={"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                         "num_attention_heads": 16, "num_key_value_heads": 8},
                  qwen2={"hidden_size": 896, "intermediate_size": 2432, "num_hidden_layers": 6,
                         "num_attention_heads": 14, "num_key_value_heads": 2})
CPU_SIZES = Sizes(steps=6, checkpoint_every=3, warmup=1, micro=8, global_batch=16,
                  llama={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2},
                  qwen2={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2})


@dataclass
class Result:
    row: str
    status: str = "pass"  # pass | FAIL | skipped
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append((name, ok, detail))
        if not ok:
            self.status = "FAIL"
        return ok


def _flash_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("flash_attn") is not None


def _save_qwen2(folder: Path, sizes: dict[str, int]) -> Path:
    """A small Qwen2-like model (q/k/v bias, GQA) saved as a Hugging Face folder, with the bundled tiny tokenizer:
    the ``qwen2`` row then loads it from ``model.path`` as it would a hub checkpoint. No download."""
    import torch
    import transformers

    from finetune.runtime.backends import _unwrap_without_importing_deepspeed

    if (folder / "config.json").exists():
        return folder
    _unwrap_without_importing_deepspeed()  # save_pretrained's unwrap would import DeepSpeed: ~3 s of CPU
    config = transformers.Qwen2Config(vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True,
                                      **sizes)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for f in (ROOT / "finetune" / "assets" / "tiny-llama-tokenizer").iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def _recipe(path: Path, name: str, model: Model, sizes: Sizes, *, reference: bool, compile_: bool,
            attn: str | None) -> Path:
    """A recipe for one run: the fp32 reference (plain path) or the row under test (bf16, packing, ...)."""
    recipe = {
        "name": name,
        "model": {**model.section, "attn_implementation": None if reference else attn},
        "data": {"format": "alpaca", "train": str(DATA / "reverse_train.jsonl"),
                 "eval": str(DATA / "reverse_eval.jsonl"), "max_seq_len": 64, "packing": not reference},
        "train": {"seed": 7, "micro_batch_size": sizes.micro, "global_batch_size": sizes.global_batch,
                  "max_steps": sizes.steps, "mixed_precision": "no" if reference else "bf16",
                  "compile": compile_ and not reference},
        "optim": {"name": "adamw", "lr": 1e-3},
        "scheduler": {"name": "cosine", "warmup_steps": 2},
        "eval": {"every_steps": None, "metrics": ["token_accuracy"], "batch_size": 50},
        "checkpoint": ({"every_steps": None, "save_final": False} if reference
                       else {"every_steps": sizes.checkpoint_every, "keep_last": 3}),
        "logging": {"every_steps": 1, "progress": False},
    }
    path.write_text(json.dumps(recipe, indent=1))  # JSON is YAML
    return path


class Runner:
    """Runs the CLI with the measurement hook, logging every command and its output to ``log``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.log = out / "commands.log"
        self.lock = threading.Lock()

    def __call__(self, args: list[str], measure: Path | None = None, timeout: float = 3600) -> tuple[int, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
        env["FINETUNE_HOOKS"] = ",".join(filter(None, [env.get("FINETUNE_HOOKS"), "gpu_check"]))
        env.pop(HOOK_ENV, None)
        if measure is not None:
            measure.mkdir(parents=True, exist_ok=True)
            env[HOOK_ENV] = str(measure)
        cmd = [sys.executable, "-m", "finetune", *args]
        started = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=self.out, capture_output=True, text=True, timeout=timeout)
        with self.lock, open(self.log, "a") as f:
            f.write(f"$ finetune {' '.join(args)}   # exit {proc.returncode}, {time.perf_counter() - started:.1f} s\n"
                    f"{proc.stdout}{proc.stderr}\n")
        return proc.returncode, proc.stdout + proc.stderr


def _train_losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


def _final_eval(run: Path) -> dict[str, Any] | None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    return evals[-1] if evals else None


def _max_rel(a: dict[int, float], b: dict[int, float], steps: list[int]) -> float:
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in steps)


def _flops_coefficients(recipe: Path) -> tuple[float, float] | None:
    """(FLOPs per input token, FLOPs per squared sample length) of the recipe's model, from a meta-device build."""
    import torch
    import transformers

    from finetune.config import load_recipe
    from finetune.registry import recipe_row
    from finetune.runtime import flops
    from finetune.runtime.modeling import build_config

    cfg, _ = load_recipe(recipe)
    row = recipe_row(cfg)
    config = build_config(cfg.model, row)
    with torch.device("meta"):
        model = getattr(transformers, row.auto_class).from_config(config)
    tied = getattr(config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None
    head = model.get_output_embeddings().weight.numel() if tied else 0
    params, attn = flops.params_of(model), flops.attention_of(config)
    one = flops.train_flops(params, attn, [1], tied_head_numel=head)
    two = flops.train_flops(params, attn, [2], tied_head_numel=head)
    if one is None or two is None:
        return None
    per_square = (two - 2 * one) / 2
    return one - per_square, per_square


def _throughput(measure: Path, sizes: Sizes, coeffs: tuple[float, float] | None,
                peak: float | None) -> dict[str, Any]:
    """Input tokens/s per device and MFU over the timed steps: after warm-up, and not a step that saved a
    checkpoint (a step's time runs from the previous step boundary to its own, so it includes its save)."""
    per_rank = []
    for f in sorted(measure.glob("rank*.jsonl")):
        rows = {r["step"]: r for r in map(json.loads, f.read_text().splitlines())}
        tokens = squares = 0
        seconds = 0.0
        for step, r in rows.items():
            prev = rows.get(step - 1)
            if prev is None or step <= sizes.warmup or step % sizes.checkpoint_every == 0:
                continue
            tokens += r["tokens"] - prev["tokens"]
            squares += r["squares"] - prev["squares"]
            seconds += r["t"] - prev["t"]
        peaks = [r["peak_bytes"] for r in rows.values() if r["peak_bytes"] is not None]
        per_rank.append({"tokens": tokens, "squares": squares, "seconds": seconds,
                         "peak_bytes": max(peaks) if peaks else None,
                         "device": next(iter(rows.values()))["device"] if rows else "?"})
    if not per_rank or not all(r["seconds"] > 0 for r in per_rank):
        return {"tokens_per_s_per_device": None, "mfu": None, "peak_bytes": None, "device": "?"}
    rate = sum(r["tokens"] / r["seconds"] for r in per_rank) / len(per_rank)
    mfu = None
    if coeffs is not None and peak:
        achieved = sum((coeffs[0] * r["tokens"] + coeffs[1] * r["squares"]) / r["seconds"]
                       for r in per_rank) / len(per_rank)
        mfu = achieved / peak
    peaks = [r["peak_bytes"] for r in per_rank if r["peak_bytes"] is not None]
    return {"tokens_per_s_per_device": rate, "mfu": mfu, "peak_bytes": max(peaks) if peaks else None,
            "device": per_rank[0]["device"], "timed_tokens": sum(r["tokens"] for r in per_rank)}


def _launch(row: Row) -> list[str]:
    return ["--accelerate-config", row.accelerate_config, "--num-processes", str(row.processes)]


def _slug(row: Row) -> str:
    return row.name.replace(" ", "-").replace(",", "")


def run_row(row: Row, sizes: Sizes, out: Path, run: Runner, refs: dict[str, dict[int, float] | None],
            plan_out: tuple[int, str], peak_override: float | None) -> Result:
    """Train, resume from the middle, export the middle checkpoint, evaluate the export; check each (and the plan
    ``finetune plan --json`` printed, ``plan_out``). A row that does not train checks its plan only."""
    from finetune.runtime import flops

    res = Result(row.name)
    slug = _slug(row)
    recipe = out / f"{slug}.yaml"
    rundir, measure = out / "runs" / slug, out / "measure" / slug
    shutil.rmtree(measure, ignore_errors=True)  # the hook appends: no figures from an earlier check in this folder
    code, text = plan_out
    found = [line for line in text.splitlines() if line.startswith("{")] if code == 0 else []
    plan = json.loads(found[0]) if found else None
    res.check("plan", plan is not None, "finetune plan --json" if plan else f"exit {code}: {text.strip()[-300:]}")
    if not row.train:
        res.note = "planned only in --dry-run (the qwen2 row trains through every check)"
        res.figures["plan_bytes"] = plan["device_total_bytes"] if plan else None
        return res
    code, text = run(["run", str(recipe), "-o", str(rundir), "--overwrite", *_launch(row)], measure=measure)
    if not res.check("run", code == 0, f"{sizes.steps} steps" if code == 0 else f"exit {code}: {text[-500:]}"):
        return res
    straight = _train_losses(rundir)
    ref = refs.get(row.model.name)
    steps = list(range(1, sizes.steps + 1))
    if ref is None:
        res.check("loss parity", False, "the fp32 reference run failed")
    else:
        worst = _max_rel(straight, ref, steps)
        res.check("loss parity", worst <= LOSS_RTOL,
                  f"max |loss - fp32| / fp32 over {len(steps)} steps = {worst:.2e} (tolerance {LOSS_RTOL:g})")
    _resume_export_eval(res, sizes, out, run, rundir, straight, _final_eval(rundir))
    measured = _throughput(measure, sizes, _flops_coefficients(recipe),
                           flops.peak_flops(_device_name(measure), peak_override))
    res.figures.update(measured)
    res.figures["plan_bytes"] = plan["device_total_bytes"] if plan else None
    if measured["peak_bytes"] is not None and plan:
        ratio = measured["peak_bytes"] / plan["device_total_bytes"]
        res.check("peak memory vs plan", ratio <= PLAN_SLACK,
                  f"measured/plan = {ratio:.2f} (fails above {PLAN_SLACK:g})")
    return res


def _resume_export_eval(res: Result, sizes: Sizes, out: Path, run: Runner, rundir: Path,
                        straight: dict[int, float], final_eval: dict[str, Any] | None) -> None:
    """Resume from the middle checkpoint (losses repeat), export it (verified), evaluate the final export."""
    slug = rundir.name
    mid = f"step-{sizes.checkpoint_every:06d}"
    code, text = run(["resume", str(rundir), "--from", mid])
    if res.check("resume", code == 0, f"--from {mid}" if code == 0 else f"exit {code}: {text[-500:]}"):
        again = _train_losses(rundir)
        later = list(range(sizes.checkpoint_every + 1, sizes.steps + 1))
        worst = _max_rel(again, straight, later)
        res.check("resume parity", worst <= RESUME_RTOL,
                  f"max relative loss difference, steps {later[0]}-{later[-1]} = {worst:.2e} "
                  f"(tolerance {RESUME_RTOL:g})")
    code, text = run(["export", str(rundir), "--from", mid, "-o", str(out / "exports" / f"{slug}-{mid}"),
                      "--overwrite"])
    res.check("export", code == 0,
              f"{mid}, verified by finetune export" if code == 0 else f"exit {code}: {text[-500:]}")
    code, text = run(["eval", str(rundir / "final"), "--json"])
    if res.check("eval of the export", code == 0 and final_eval is not None, f"exit {code}" if code else "ran"):
        got = json.loads(next(line for line in text.splitlines() if line.startswith("{")))
        rel = abs(got["eval_loss"] - final_eval["eval_loss"]) / final_eval["eval_loss"]
        res.check("export parity", rel <= EVAL_RTOL, f"eval_loss {got['eval_loss']:.5f} vs the run's "
                  f"{final_eval['eval_loss']:.5f}: {rel:.1e} (tolerance {EVAL_RTOL:g})")


def _device_name(measure: Path) -> str | None:
    for f in measure.glob("rank*.jsonl"):
        first = f.read_text().splitlines()[:1]
        if first:
            return json.loads(first[0])["device"]
    return None


def matrix(gpus: int, out: Path, sizes: Sizes, dry: bool) -> list[Row]:
    """The rows: one GPU (Llama-like, and Qwen2-like from a saved folder), then FSDP2 and ZeRO-3 on every GPU."""
    qwen2 = _save_qwen2(out / "qwen2-model", sizes.qwen2)
    llama = Model("llama", {"type": "tiny-llama", "config_overrides": sizes.llama})
    qwen = Model("qwen2", {"type": "qwen2", "path": str(qwen2)})
    one = "cpu" if dry else "1 GPU"
    # compile on the CPU: torch 2.13's inductor failed to generate code for this bf16 + packing model here
    # (AssertionError in codegen of a float64 atomic-add scatter), so --dry-run leaves it to the GPU rows
    rows = [Row(f"llama {one}", llama, compile=not dry, train=not dry), Row(f"qwen2 {one}", qwen)]
    multi = ("--dry-run runs one CPU process" if dry else
             f"needs 2+ GPUs, found {gpus}" if gpus < 2 else None)
    for backend in ("fsdp2", "zero3"):
        rows.append(Row(f"llama {backend} x{max(gpus, 2)}", llama, accelerate_config=backend,
                        processes=max(gpus, 2), skip=multi))
    return rows


def machine(dry: bool) -> dict[str, Any]:
    import accelerate
    import torch
    import transformers

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "python": platform.python_version(),
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "mode": "--dry-run (CPU)" if dry else "GPU",
    }
    for name in ("deepspeed", "flash-attn", "peft"):
        try:
            info[name] = importlib.metadata.version(name)  # the installed version, without importing it
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    return info


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if unit == "bytes":
        return f"{value / 2**20:,.1f} MiB"
    if unit == "%":
        return f"{100 * value:.1f}%"
    return f"{value:,.0f}"


def report(info: dict[str, Any], results: list[Result], notes: list[str]) -> str:
    ok = all(r.status != "FAIL" for r in results)
    lines = [f"# finetune GPU check: {'PASS' if ok else 'FAIL'}", "",
             "Written by `scripts/gpu_check.py`" + (" --dry-run" if "dry" in info["mode"] else "") + ".", "",
             "## Machine", ""] + [f"- {k}: {v}" for k, v in info.items()] + [""]
    lines += ["## Runs", "", "| row | status | input tok/s per device | MFU | peak memory | plan (device total) |",
              "|---|---|---|---|---|---|"]
    for r in results:
        f = r.figures
        lines.append(f"| {r.row} | {r.status}{': ' + r.note if r.note else ''} | "
                     f"{_fmt(f.get('tokens_per_s_per_device'))} | {_fmt(f.get('mfu'), '%')} | "
                     f"{_fmt(f.get('peak_bytes'), 'bytes')} | {_fmt(f.get('plan_bytes'), 'bytes')} |")
    lines += ["", "## Checks", ""]
    for r in results:
        for name, passed, detail in r.checks:
            lines.append(f"- {r.row}: {name}: {'pass' if passed else 'FAIL'} ({detail})")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def out_problem(out: Path) -> str | None:
    """Why ``--out`` cannot be the check's folder (one line naming it and the fix), or None: it must be a folder or
    not exist yet, and not a symbolic link (the check writes its runs, logs and report there, never through a
    link)."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"--out {out}: cannot be used ({exc.strerror}); give a folder for the check's runs and report"
    if stat.S_ISDIR(mode):
        return None
    what = "a symbolic link" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else "not a folder"
    return f"--out {out} is {what}; give a folder for the check's runs and report (a new one, or an earlier check's)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the matrix shrunk to tiny models on the CPU")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="folder for runs and the report")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak, when the table does not know it (or to override it)")
    args = parser.parse_args(argv)
    if problem := out_problem(args.out):  # before any work: a file there is never the report's folder
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
    # every run of a model takes the same global batch, divisible by the multi-GPU rows' micro-batches x processes
    sizes = CPU_SIZES if args.dry_run else dataclasses.replace(
        GPU_SIZES, global_batch=GPU_SIZES.micro * 2 * max(gpus, 1))
    notes = [f"Loss parity: every step's loss against the fp32 single-process reference of the same model, "
             f"relative tolerance {LOSS_RTOL:g}; resume parity {RESUME_RTOL:g}; export eval parity {EVAL_RTOL:g}; "
             f"peak memory fails above {PLAN_SLACK:g} x the plan.",
             "Tokens/s counts input tokens (padding excluded) over steps after warm-up that saved no checkpoint. "
             "MFU uses finetune.runtime.flops (matmuls and full attention per sample) against the dense bf16 peak "
             "table; an unknown device gets none."]
    attn = None
    if args.dry_run:
        notes.append("Nothing in this report ran on a GPU: --dry-run trains tiny models on the CPU; peak device "
                     "memory and MFU are n/a there.")
    elif _flash_available():
        attn = "flash_attention_2"
    else:
        notes.append("flash-attn is not installed: the rows use sdpa (install flash-attn to check it).")
    if args.dry_run:
        notes.append("flash-attn skipped: --dry-run runs on the CPU, and flash-attn needs CUDA.")
        notes.append("torch.compile skipped: on this CPU, torch 2.13's inductor failed to generate code for the "
                     "bf16 + packing model (AssertionError in codegen); the GPU rows compile.")
    info = machine(args.dry_run)
    run = Runner(out)
    rows = matrix(gpus, out, sizes, args.dry_run)
    active = [r for r in rows if r.skip is None]
    models = {r.model.name: r.model for r in active if r.train}
    # the fp32 references and the plans measure nothing: they run side by side, before the timed rows
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        ref_jobs = {}
        for model in models.values():
            recipe = _recipe(out / f"{model.name}-fp32.yaml", f"{model.name}-fp32", model, sizes, reference=True,
                             compile_=False, attn=None)
            ref_jobs[model.name] = pool.submit(run, ["run", str(recipe), "-o", str(out / "runs" / f"{model.name}-fp32"),
                                                     "--overwrite"])
        plan_jobs = {}
        for row in active:
            recipe = _recipe(out / f"{_slug(row)}.yaml", _slug(row), row.model, sizes, reference=False,
                             compile_=row.compile, attn=attn)
            plan_jobs[row.name] = pool.submit(run, ["plan", str(recipe), *_launch(row), "--json"])
        refs = {name: _train_losses(out / "runs" / f"{name}-fp32") if job.result()[0] == 0 else None
                for name, job in ref_jobs.items()}
        plans = {name: job.result() for name, job in plan_jobs.items()}
    results = []
    for row in rows:
        if row.skip:
            results.append(Result(row.name, status="skipped", note=row.skip))
            continue
        print(f"gpu-check: {row.name} ...", flush=True)
        results.append(run_row(row, sizes, out, run, refs, plans[row.name], args.peak_tflops))
    text = report(info, results, notes)
    (out / "gpu-check-report.md").write_text(text)
    (out / "gpu-check-report.json").write_text(json.dumps(
        {"machine": info, "notes": notes, "results": [r.__dict__ for r in results]}, indent=1, default=str))
    print(text)
    return 0 if all(r.status != "FAIL" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
