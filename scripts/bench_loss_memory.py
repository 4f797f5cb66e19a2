"""Benchmark: peak memory of one forward+backward with the old fp32-upcast loss vs the chunked one.

    .venv/bin/python scripts/bench_loss_memory.py [--out bench-loss-memory.md] [--batch 4] [--seq 1024]

What it measures: a Llama-architecture model built from ``transformers.LlamaConfig`` (vocab 32000, hidden 256,
2 layers, 4 heads, intermediate 688; random weights, no download) runs one forward and backward on a micro-batch
of random token ids (default 4 x 1024, the first 1/8 of each row masked as a prompt), in fp32 and in bf16
(``torch.autocast`` with fp32 weights, so the logits are bf16), with two next-token losses:

* ``before``: a copy of the old ``shifted_loss`` (``logits[:, :-1].float()`` then ``F.cross_entropy``), which
  makes an fp32 copy of the logits and keeps an fp32 log-softmax of the same size for backward;
* ``after``: ``finetune.tasks.losses.summed_cross_entropy`` on ``logits.view(-1, V)`` with the LABELS shifted
  (``F.pad(labels[:, 1:], (0, 1), value=-100)``), so the logits are never sliced or copied.

Each (dtype, implementation) runs in its own fresh subprocess so peaks never mix. Reported: the peak growth over
the process's memory just before the forward. On CPU that is resident memory: the high-water mark (VmHWM in
/proc/self/status) is reset by writing "5" to /proc/self/clear_refs, else ``ru_maxrss`` is used (then the
baseline must be the peak so far, which the warm-up keeps small). The children run with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB so every large tensor is its own mapping, returned on free: resident
memory then follows what torch allocates instead of what the allocator happens to keep. On CUDA it is
``torch.cuda.max_memory_allocated`` over ``memory_allocated`` before the forward. Also reported: the summed loss
of each run (the two implementations must agree within 1e-6 relative; the script exits 1 otherwise) and the
seconds of the forward+backward. The table and the machine are printed and written to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VOCAB = 32000
MODEL = {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 688}
RTOL = 1e-6
MIB = 2**20


def old_shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss as finetune.tasks.logprobs.shifted_loss computed it before the chunked loss (the "before" run)."""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")


def new_shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The chunked loss on the unsliced logits, with the labels shifted instead (the "after" run)."""
    from finetune.tasks.losses import summed_cross_entropy

    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    return summed_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


LOSSES = {"before": old_shifted_loss, "after": new_shifted_loss}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the resident high-water mark (VmHWM); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024


def _step(model: Any, ids: torch.Tensor, labels: torch.Tensor, dtype: str, impl: str, device: str) -> float:
    """One forward + backward; returns the summed loss."""
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16")
    with autocast:
        logits = model(input_ids=ids, use_cache=False).logits
    loss = LOSSES[impl](logits, labels)
    loss.backward()
    return loss.item()


def child(dtype: str, impl: str, batch: int, seq: int) -> dict[str, Any]:
    """Build the model, warm up on a tiny batch, then measure one full-size step; returns the measurements."""
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, max_position_embeddings=seq)).to(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen).to(device)
    labels = ids.clone()
    labels[:, : seq // 8] = -100
    _step(model, ids[:1, :32], labels[:1, :32], dtype, impl, device)  # lazy init (kernels, autocast caches)
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        hwm_reset = _reset_peak_rss()
        base = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    loss = _step(model, ids, labels, dtype, impl, device)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device == "cuda":
        peak, method = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
    elif hwm_reset:
        peak, method = _status_kib("VmHWM") * 1024, "VmHWM after clear_refs"
    else:
        peak, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
    return {"dtype": dtype, "impl": impl, "peak_mib": (peak - base) / MIB, "loss": loss, "seconds": seconds,
            "device": device, "method": method}


def machine() -> str:
    """CPU model, cores, torch version and the accelerator, if any."""
    cpu = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    text = f"CPU: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f"; GPU: {torch.cuda.get_device_name(0)}"
    return text


def run_child(dtype: str, impl: str, batch: int, seq: int) -> dict[str, Any]:
    """One measurement in a fresh interpreter (its own allocator and high-water mark)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--child", dtype, impl, "--batch", str(batch), "--seq", str(seq)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{dtype}/{impl} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results: list[dict[str, Any]], batch: int, seq: int) -> tuple[str, bool]:
    """The markdown report and whether before/after agree within RTOL for every dtype."""
    lines = [f"# Loss memory: one forward+backward, Llama vocab {VOCAB}, micro-batch {batch} x {seq}", "",
             machine() + f"; measured with {results[0]['method']} on {results[0]['device']}", "",
             "| dtype | implementation | peak MiB | loss (sum) | seconds |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['dtype']} | {r['impl']} | {r['peak_mib']:.0f} | {r['loss']:.6f} | {r['seconds']:.2f} |"
              for r in results]
    lines.append("")
    agree = True
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        before, after = (next(r for r in results if r["dtype"] == dtype and r["impl"] == impl)
                         for impl in ("before", "after"))
        rel = abs(after["loss"] - before["loss"]) / max(abs(before["loss"]), 1e-30)
        saved = before["peak_mib"] - after["peak_mib"]
        ok = rel <= RTOL
        agree &= ok
        lines.append(f"- {dtype}: loss relative difference {rel:.2e} ({'ok' if ok else 'FAIL'}, limit {RTOL:g}); "
                     f"peak {saved:.0f} MiB lower ({saved / max(before['peak_mib'], 1e-9):.0%})")
    logits_mib = batch * seq * VOCAB / MIB
    lines.append(f"- logits [{batch}, {seq}, {VOCAB}]: {4 * logits_mib:.0f} MiB in fp32, {2 * logits_mib:.0f} MiB "
                 "in bf16")
    return "\n".join(lines) + "\n", agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-loss-memory.md", help="markdown file for the table")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--child", nargs=2, metavar=("DTYPE", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.batch, args.seq)))
        return
    results = [run_child(dtype, impl, args.batch, args.seq) for dtype in ("fp32", "bf16") for impl in LOSSES]
    text, agree = report(results, args.batch, args.seq)
    print(text, end="")
    Path(args.out).write_text(text)
    print(f"written to {args.out}")
    sys.exit(0 if agree else 1)


if __name__ == "__main__":
    main()
