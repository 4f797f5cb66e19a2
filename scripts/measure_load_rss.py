"""Measure: each rank's peak memory while 2 processes build and prepare a model loaded from disk, with every rank
reading the weights (the old behaviour) and with rank 0 alone reading them (finetune.runtime.materialize).

    .venv/bin/python scripts/measure_load_rss.py [--out docs/load-rss.md] [--backends ddp fsdp2 zero3]
        [--hidden 1024 --layers 12 --intermediate 2816] [--allocator mmap64k|default] [--max-load 1.5 --wait 600]

What it does: a Llama-architecture model (default hidden 1024, 12 layers, 16 heads, intermediate 2816, vocab 512 for
the bundled tokenizer: ~155M parameters, random weights) is saved in fp32 with ``save_pretrained`` into a temporary
folder. For each backend and each behaviour a fresh ``accelerate launch`` of 2 processes runs this script's child
mode on every rank: import what the worker imports on its way, reset the resident high-water mark (``VmHWM``, by
writing 5 to /proc/self/clear_refs), run ``finetune.runtime.worker.build_trainer`` (accelerator, tokenizer, data, model,
optimizer, ``accelerator.prepare``; no training step) while a thread samples /proc/self/smaps_rollup every 20 ms,
then read ``VmHWM``. The old behaviour is the same code with ``FINETUNE_LOAD_EVERYWHERE=1``. Reported per rank, as
growth over the process before the build: peak RSS (VmHWM; it counts the weight file's pages a rank maps and
touches), peak PSS (file pages shared by the ranks split between them) and peak private (anonymous) memory, and
the seconds of the build. By default the children run with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB, as
scripts/bench_loss_memory.py does, so resident memory follows what is allocated rather than what the allocator
keeps (``--allocator default``: glibc's defaults). The table, the machine, the model and the command are printed
and written to ``--out``.

It waits (up to ``--wait`` seconds) for the 1-minute load average to fall below ``--max-load`` before it starts, so
that other work on the machine does not distort the timings, and records the load at the start and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BEHAVIOURS = {"every rank reads": {"FINETUNE_LOAD_EVERYWHERE": "1"}, "rank 0 reads": {"FINETUNE_LOAD_EVERYWHERE": "0"}}
# glibc's defaults, or every allocation over 64 KiB its own mapping, returned when freed: resident memory then
# follows what is allocated instead of what the allocator keeps for reuse (its threshold otherwise grows with frees)
ALLOCATORS = {"default": {}, "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rollup_kib() -> dict[str, int]:
    """Pss (shared pages divided among the processes that map them) and Anonymous (private memory) in KiB."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        fields[name] = int(rest.split()[0])
    return {"pss": fields["Pss"], "anon": fields["Anonymous"]}


class PeakSampler(threading.Thread):
    """Samples :func:`_rollup_kib` every ``every`` seconds and keeps the largest values (the kernel keeps a
    high-water mark for RSS only). A peak shorter than the interval can be missed."""

    def __init__(self, every: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.every, self.peak, self.done = every, _rollup_kib(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            for key, value in _rollup_kib().items():
                self.peak[key] = max(self.peak[key], value)

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.join()
        for key, value in _rollup_kib().items():
            self.peak[key] = max(self.peak[key], value)
        return self.peak


def child(resolved: Path, out: Path) -> None:
    """On every rank under the launcher: build and prepare the run of ``resolved``; write this rank's memory."""
    import importlib

    from finetune.backends import detect
    from finetune.config import load_resolved
    from finetune.runtime.worker import build_trainer

    # what building imports on the way, loaded first so that "before" is the process without a model
    for module in ("torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict", "accelerate", "datasets",
                   "peft", "transformers.models.llama.modeling_llama", "finetune.runtime.loop", "finetune.data",
                   "finetune.tasks", "finetune.runtime.tracking", "finetune.runtime.materialize",
                   "finetune.artifacts.probe", "finetune.artifacts.portable",
                   *((detect().package,) if detect().package else ())):
        importlib.import_module(module)
    cfg = load_resolved(resolved)
    before = {"rss": _status_kib("VmRSS"), **_rollup_kib()}
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    trainer = build_trainer(cfg, Path(cfg.output_dir or "."))
    seconds = time.perf_counter() - start
    peak = {"rss": _status_kib("VmHWM"), **sampler.stop()}
    row = {"rank": trainer.ctx.accelerator.process_index, "backend": trainer.ctx.backend.name, "before": before,
           "peak": peak, "seconds": round(seconds, 2)}
    (out.parent / f"{out.name}.rank{row['rank']}.json").write_text(json.dumps(row))
    trainer.tracker.close()
    trainer.ctx.accelerator.end_training()


def save_model(folder: Path, hidden: int, layers: int, intermediate: int) -> int:
    """A random fp32 Llama saved as a hub checkpoint would be (with the bundled tokenizer); its parameter count."""
    import torch
    import transformers

    from finetune.runtime.modeling import ASSETS

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=16, num_key_value_heads=16, vocab_size=512,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def recipe(model: Path, backend: str) -> dict[str, Any]:
    return {
        "name": "load-rss", "model": {"type": "llama", "path": str(model)},
        "data": {"format": "alpaca", "train": str(REPO / "recipes" / "data" / "reverse_train.jsonl"), "eval": None,
                 "max_seq_len": 64},
        "train": {"micro_batch_size": 1, "global_batch_size": 2, "max_steps": 1},
        "eval": {"every_steps": None}, "checkpoint": {"every_steps": None, "save_final": False},
        "logging": {"progress": False}, "launch": {"accelerate_config": backend, "num_processes": 2},
    }


def measure(work: Path, model: Path, backend: str, behaviour: str, allocator: dict[str, str]) -> list[dict[str, Any]]:
    """One 2-process launch of :func:`child` (``allocator``: glibc malloc settings in its environment); each
    rank's row."""
    import yaml

    from finetune import backends
    from finetune.config import load_recipe
    from finetune.storage import rundir

    name = f"{backend}-{'old' if behaviour == 'every rank reads' else 'new'}"
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**recipe(model, backend), "output_dir": str(work / name)}))
    cfg, _ = load_recipe(path)
    run = work / name
    with rundir.create(run, overwrite=False):
        resolved = rundir.write_resolved(cfg, run)
        config = backends.accelerate_config(backend).path
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
                "2", str(Path(__file__).resolve()), "--child", str(resolved), "--child-out", str(run)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **BEHAVIOURS[behaviour], **allocator}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads((work / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]
    note = next((line for line in (run / "train.log").read_text().splitlines() if " model: " in line), "")
    for row in rows:
        row.update(behaviour=behaviour, log=note.split(" model: ", 1)[-1])
    return rows


def load_average() -> float:
    return os.getloadavg()[0]


def wait_for_quiet(max_load: float, wait: float) -> float:
    """Wait until the 1-minute load average is below ``max_load`` (at most ``wait`` seconds); the load then."""
    deadline = time.monotonic() + wait
    while (load := load_average()) >= max_load:
        if time.monotonic() > deadline:
            raise SystemExit(f"the 1-minute load average is {load:.2f} (>= {max_load}) after waiting {wait:.0f} s: "
                             "the machine is busy; try again later or raise --max-load")
        print(f"load average {load:.2f} >= {max_load}: waiting", file=sys.stderr)
        time.sleep(15)
    return load


def machine() -> str:
    import torch

    cpu = platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")]
    memory = _meminfo_gib()
    return (f"{names[0] if names else cpu}, {os.cpu_count()} cores, {memory:.0f} GiB memory, no GPU"
            if not torch.cuda.is_available() else f"{names[0] if names else cpu} with CUDA")


def _meminfo_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def versions() -> str:
    import accelerate
    import deepspeed
    import torch
    import transformers

    return (f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}"
            f", DeepSpeed {deepspeed.__version__}")


def mib(kib: int) -> str:
    return f"{kib / 1024:.0f}"


def report(rows: list[dict[str, Any]], params: int, command: str, loads: tuple[float, float], started: str,
           minutes: float, allocator: str) -> str:
    by = {(r["backend"], r["behaviour"], r["rank"]): r for r in rows}
    malloc = ("glibc's allocator with its defaults" if not ALLOCATORS[allocator] else
              "glibc's `MALLOC_MMAP_THRESHOLD_=65536` (every allocation over 64 KiB is its own mapping, returned "
              "when freed, so resident memory follows what is allocated rather than what the allocator keeps)")
    lines = [
        "# Peak resident memory per rank while loading a model from disk at 2 processes",
        "",
        f"Measured {started} with `scripts/measure_load_rss.py` ({minutes:.1f} min), on {machine()}; "
        f"{versions()}; {malloc}. 1-minute load average {loads[0]:.2f} at the start and {loads[1]:.2f} at the end "
        "(the script waits for it to be below 1.5 before it starts; other work shared the machine).",
        "",
        f"Model: Llama architecture, {params / 1e6:.0f}M parameters, fp32 ({params * 4 / 2**20:.0f} MiB of weights),"
        " saved with `save_pretrained` (one `model.safetensors`) and loaded through `model.path`.",
        "",
        "Command:",
        "",
        "```bash",
        command,
        "```",
        "",
        "Each row is one rank; each cell pair is two fresh 2-process `accelerate launch`es that run "
        "`finetune.runtime.worker.build_trainer` (accelerator, tokenizer, data, model, optimizer, "
        "`accelerator.prepare`; no training step): *old* is every rank reading the weights "
        "(`FINETUNE_LOAD_EVERYWHERE=1`, the behaviour before), *new* is rank 0 alone reading them (the default "
        "now). MiB, as growth over the process after its "
        "imports (*before*, the old run's):",
        "",
        "- **RSS**: the kernel's resident high-water mark (VmHWM, reset before the build). It counts the pages of "
        "the mapped weight file that the rank touched as well as what it allocated;",
        "- **PSS**: proportional set size (file pages shared by both ranks count half in each), and **anon**: "
        "private memory; both the largest of samples taken every 20 ms from /proc/self/smaps_rollup.",
        "",
        "| backend | rank | before | RSS old → new | PSS old → new | anon old → new | build + prepare s old → new |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend in dict.fromkeys(r["backend"] for r in rows):
        for rank in (0, 1):
            old, new = by[(backend, "every rank reads", rank)], by[(backend, "rank 0 reads", rank)]
            cells = [f"{mib(old['peak'][k] - old['before'][k])} → {mib(new['peak'][k] - new['before'][k])}"
                     for k in ("rss", "pss", "anon")]
            lines.append(f"| {backend} | {rank} | {mib(old['before']['rss'])} | {' | '.join(cells)} | "
                         f"{old['seconds']:.1f} → {new['seconds']:.1f} |")
    lines += ["", "What each run logged about the model (train.log):", ""]
    for row in rows:
        if row["rank"] == 0:
            lines.append(f"- {row['backend']}, {row['behaviour']}: `{row['log']}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "load-rss.md")
    parser.add_argument("--backends", nargs="+", default=["ddp", "fsdp2", "zero3"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--allocator", choices=list(ALLOCATORS), default="mmap64k")
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--wait", type=float, default=600)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.child_out)
        return
    command = "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]])
    load_start = wait_for_quiet(args.max_load, args.wait)
    started, t0 = datetime.now().strftime("%Y-%m-%d %H:%M"), time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="load-rss-"))
    try:
        params = save_model(work / "model", args.hidden, args.layers, args.intermediate)
        rows: list[dict[str, Any]] = []
        for backend in args.backends:
            for behaviour in BEHAVIOURS:
                rows += measure(work, work / "model", backend, behaviour, ALLOCATORS[args.allocator])
                print(f"{backend}, {behaviour}: " + ", ".join(
                    f"rank {r['rank']} peak RSS {mib(r['peak']['rss'])} MiB" for r in rows[-2:]), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(rows, params, command, (load_start, load_average()), started, (time.monotonic() - t0) / 60,
                  args.allocator)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
