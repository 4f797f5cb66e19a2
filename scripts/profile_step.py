"""Where a training step's time goes: ``finetune run`` profiled, beside a hand-written loop on the same model.

    python3 scripts/profile_step.py --out DIR [--shape qwen2.5-0.5b|tiny] [--steps 12] [--skip-hand]

Builds the GPU check's model (``scripts/gpu_check.py``: a Qwen2.5-0.5B-shaped Qwen2 from a config, random weights,
saved in bf16; ``--shape tiny`` for the CPU) and its synthetic data, then:

1. ``hand``: a hand-written loop in this process over the same packed micro-batches finetune builds (taken from
   finetune's own train dataloader, so both see identical tokens): fp32 master weights, bf16 autocast, gradient
   checkpointing, ``model(**batch).loss`` (transformers' loss, one full-vocabulary logits tensor), torch's AdamW
   (fused on CUDA), no clipping. Step times after warm-up, synchronised.
2. ``finetune``: ``finetune run`` of the GPU check's bf16 recipe (packing, chunked loss, checkpointing, no compile,
   no checkpoints, no eval) in a subprocess whose ``after_step`` seam (``FINETUNE_HOOKS``) times every step and runs
   ``torch.profiler`` over steps ``warm+1 .. warm+3``: the tables (top operators by device time and by host time)
   go to ``DIR/finetune-profile.txt``.

It prints and writes ``DIR/profile-summary.md``: tokens/s of each, their ratio, the step times. A diagnostic for
developers, run by hand (on a lent GPU machine with ``--budget``'s bundle installed first); it asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import gpu_check  # noqa: E402  (the check's model, data and recipe)

HOOK_ENV = "PROFILE_STEP_OUT"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ the hook side
# Imported by the finetune subprocess through FINETUNE_HOOKS=profile_step: times each step and profiles three.
_times: list[float] = []
_prof: Any = None


def _after_step(trainer: Any, **_: Any) -> None:
    global _prof
    import torch

    _sync()
    _times.append(time.perf_counter())
    step, out = trainer.state.step, Path(os.environ[HOOK_ENV])
    warm = int(os.environ.get("PROFILE_STEP_WARM", "4"))
    if step == warm:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        _prof = torch.profiler.profile(activities=activities, record_shapes=False)
        _prof.__enter__()
    elif step == warm + 3 and _prof is not None:
        _prof.__exit__(None, None, None)
        table = _prof.key_averages()
        device_key = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
        text = (f"# steps {warm + 1}-{warm + 3}, by total device time\n"
                + table.table(sort_by=device_key, row_limit=30, max_name_column_width=70)
                + "\n# by self device time\n" + table.table(sort_by="self_" + device_key, row_limit=30,
                                                            max_name_column_width=70)
                + "\n# by self host time\n" + table.table(sort_by="self_cpu_time_total", row_limit=30,
                                                          max_name_column_width=70))
        (out / "finetune-profile.txt").write_text(text)
        _prof = None
    steps = [b - a for a, b in itertools.pairwise(_times)]
    (out / "finetune-steps.json").write_text(json.dumps({"step_s": steps, "tokens": trainer.state.tokens_seen}))


if os.environ.get(HOOK_ENV):
    from finetune import hooks

    hooks.register("after_step", _after_step)


# ------------------------------------------------------------------------------------------------ the driver side
def hand_loop(model_path: Path, data: Path, sizes: Any, steps: int, warm: int) -> dict[str, Any]:
    """A hand-written loop: fp32 weights, bf16 autocast, gradient checkpointing, transformers' own loss, fused
    AdamW; micro-batches of ``sizes.micro`` samples packed into one row (position ids restarting, no mask), two per
    step as the check's global batch asks. Returns the step times and the timed input tokens."""
    import torch
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    rows = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    samples = [[tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"],
                tokenizer.eos_token_id][:sizes.max_seq_len] for text in rows]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                              attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, fused=device.type == "cuda")
    per_step = sizes.global_batch // sizes.micro
    times, tokens, cursor = [], 0, 0
    _sync()
    times.append(time.perf_counter())
    for step in range(steps):
        for _ in range(per_step):
            chunk = [samples[(cursor + i) % len(samples)] for i in range(sizes.micro)]
            cursor += sizes.micro
            ids = [t for s in chunk for t in s]
            labels = [t for s in chunk for t in [-100, *s[1:]]]
            positions = [p for s in chunk for p in range(len(s))]
            batch = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
                     "position_ids": torch.tensor([positions])}
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(**batch, use_cache=False).loss
            (loss / per_step).backward()
            if step >= warm:
                tokens += len(ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        times.append(time.perf_counter())
    step_s = [b - a for a, b in itertools.pairwise(times)]
    return {"step_s": step_s, "timed_s": sum(step_s[warm:]), "tokens": tokens}


def varlen_probe(sizes: Any) -> list[str]:
    """On CUDA: whether ``torch.nn.attention.varlen.varlen_attn`` exists here, and one packed row's attention
    (forward and backward, bf16, the check's head shape) through sdpa with packing's block-diagonal mask (cuDNN off)
    against varlen_attn over the same boundaries. Lines for the summary; an error is a line too."""
    import torch

    if not torch.cuda.is_available():
        return ["- varlen probe: no CUDA"]
    lines = []
    try:
        import inspect

        from torch.nn.attention import varlen

        lines.append(f"- varlen_attn{inspect.signature(varlen.varlen_attn)}")
    except Exception as exc:
        return [f"- varlen probe: {type(exc).__name__}: {exc}"]
    heads, kv, dim = sizes.shape["num_attention_heads"], sizes.shape["num_key_value_heads"], 64
    lengths = [640, 300, 1024, 512, 700, 256, 900, 788]
    total = sum(lengths)
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, kv, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, kv, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                  torch.tensor(lengths, device="cuda"))
    mask = (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool, device="cuda").tril()

    def with_sdpa() -> torch.Tensor:
        rep = heads // kv
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.repeat_interleave(rep, 1).transpose(0, 1)[None],
            v.repeat_interleave(rep, 1).transpose(0, 1)[None], attn_mask=mask[None, None])
        return out[0].transpose(0, 1)

    def with_varlen() -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        params = inspect.signature(varlen.varlen_attn).parameters
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        elif "is_causal" in params:
            kwargs["is_causal"] = True
        kk, vv = k, v
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            kk, vv = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        return varlen.varlen_attn(q, kk, vv, bounds, bounds, max(lengths), max(lengths), **kwargs)

    torch.backends.cuda.enable_cudnn_sdp(False)
    results = {}
    for name, fn in (("sdpa+mask", with_sdpa), ("varlen_attn", with_varlen)):
        try:
            for _ in range(3):
                fn().float().sum().backward()
            _sync()
            started = time.perf_counter()
            for _ in range(20):
                out = fn()
                out.float().sum().backward()
            _sync()
            results[name] = out.detach().float()
            lines.append(f"- {name}: {(time.perf_counter() - started) / 20 * 1e3:.2f} ms forward+backward, "
                         f"{total} tokens in {len(lengths)} samples")
        except Exception as exc:
            lines.append(f"- {name}: {type(exc).__name__}: {str(exc)[:300]}")
    if len(results) == 2:
        diff = (results["sdpa+mask"] - results["varlen_attn"]).abs().max().item()
        lines.append(f"- max |sdpa+mask - varlen_attn| = {diff:.3g}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=("qwen2.5-0.5b", "tiny"), default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--skip-hand", action="store_true", help="profile finetune only")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = gpu_check.GPU_SIZES if args.shape == "qwen2.5-0.5b" else gpu_check.CPU_SIZES
    work = Path(tempfile.mkdtemp(prefix="profile-step-"))
    gpu_check.write_data(work, sizes)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "FINETUNE_DEBUG": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "scripts"),
                                                       os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--save-model", str(work / "model"),
                    "--shape", json.dumps(sizes.shape)], check=True, env=env)
    ctx = SimpleNamespace(sizes=sizes, work=work, peak_tflops=None)
    recipe = gpu_check.recipe(ctx, "profile", {  # type: ignore[arg-type]
        "data": {"eval": None}, "eval": {"metrics": []}, "train": {"max_steps": args.steps},
        "checkpoint": {"every_steps": None, "save_final": False}})
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "finetune", "run", str(recipe), "-o", str(work / "run")],
                          env={**env, "FINETUNE_HOOKS": "profile_step", HOOK_ENV: str(out),
                               "PROFILE_STEP_WARM": str(args.warm)}, cwd=work, text=True, capture_output=True)
    (out / "finetune-run.log").write_text(done.stdout + done.stderr)
    print(done.stdout[-3000:], done.stderr[-3000:], f"finetune run: exit {done.returncode}, "
          f"{time.perf_counter() - started:.1f} s", sep="\n", flush=True)
    lines = ["# profile_step", ""]
    ft = json.loads((out / "finetune-steps.json").read_text()) if (out / "finetune-steps.json").exists() else None
    if ft:
        timed = [s for i, s in enumerate(ft["step_s"], 1) if i > args.warm and not args.warm <= i <= args.warm + 3]
        lines.append(f"- finetune: median step {statistics.median(timed):.3f} s (steps after warm-up, outside the "
                     f"profiled ones); all: {', '.join(f'{s:.3f}' for s in ft['step_s'])}")
        from finetune.storage.metrics import read_metrics  # lazy: after the bundle is on the path

        rates = [row["tokens_per_s"] for row in read_metrics(work / "run")
                 if row.get("kind") == "train" and row["step"] > args.warm
                 and not args.warm < row["step"] <= args.warm + 4 and "tokens_per_s" in row]
        if rates:
            lines.append(f"- finetune: median {statistics.median(rates):,.0f} input tok/s per step (step lines, the "
                         "profiled steps and the one after left out)")
    for cudnn in ((True, False) if not args.skip_hand else ()):
        import torch

        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        hand = hand_loop(work / "model", work / "reverse_long_train.jsonl", sizes, args.steps, args.warm)
        hand_tps = hand["tokens"] / hand["timed_s"]
        lines.append(f"- hand loop, cuDNN sdpa {'on' if cudnn else 'off'}: {hand_tps:,.0f} input tok/s over steps "
                     f"{args.warm + 1}-{args.steps}; median step {statistics.median(hand['step_s'][args.warm:]):.3f} s;"
                     f" all: {', '.join(f'{s:.3f}' for s in hand['step_s'])}")
    lines += varlen_probe(sizes)
    text = "\n".join(lines) + "\n"
    (out / "profile-summary.md").write_text(text)
    print(text)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
