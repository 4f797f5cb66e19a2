"""``finetune merge``: base + LoRA adapter -> a plain Hugging Face model, verified before it is kept.

The check compares logits on fixed inputs, each forward under the recipe's ``train.mixed_precision`` autocast (the
precision the adapter was trained and recorded in), within :func:`tolerance`, three ways:
1. base + adapter (as loaded now) vs the reference the training run recorded in ``final/merge_check.safetensors``
   (catches a tampered or mismatched adapter, or a different base);
2. the merged model, saved and loaded back from disk, vs base + adapter (catches a bad merge or save).
The merged model is written to a fresh ``.tmp`` folder beside ``<out>`` and renamed only when every check passes, so
a failed merge leaves nothing behind. ``-o`` may not overlap the source (the adapter or its run), the source run is
locked while it is read, and ``--overwrite`` replaces only a model an earlier merge wrote (its manifest lists every
file). A QLoRA adapter is merged into the full-precision (dequantized) base, and the output says so.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml

from finetune import outputs, rundir
from finetune.config import to_yaml
from finetune.errors import FinetuneError, RunDirError


class MergeCheckError(FinetuneError):
    """The merged model does not reproduce the adapter's logits."""

    exit_code = 1


HALF = ("bfloat16", "float16", "bf16", "fp16")  # weight dtypes and autocast modes that compute in 16 bits
HALF_FLOOR, HALF_RELATIVE = 5e-2, 2.0 ** -5  # half precision: at least 0.05, or 1/32 of the largest |logit|


def tolerance(dtype: str, quantized: bool = False, mixed_precision: str = "no", scale: float = 0.0) -> float:
    """Max |delta logit| accepted between two forwards of the same weights (what :func:`tolerance_rule` says).

    float32 compute (fp32 weights, no autocast) accumulates ~1e-6 here: 1e-4. 4-bit kernels (QLoRA's recorded
    logits) are not reproducible to better than ~1e-3 across processes: 2e-2. Half-precision compute (bf16/fp16
    weights, or ``train.mixed_precision`` bf16/fp16 autocast over fp32 weights) rounds every activation and the
    logits themselves to 8 (bf16) or 11 (fp16) significant bits, and a probe recorded on one device (a GPU, with
    flash-attn) is compared with a reload on another (the CPU, with sdpa): the kernels sum in other orders, so a
    rounding can flip in any layer. One bf16 step at a logit of 20 is already 0.125. So half precision accepts
    max(0.05, 1/32 of the largest |logit| of the reference, ``scale``): about four bf16 steps at the largest logit,
    which still refuses a wrong conversion (a missing or swapped layer moves the logits by their own size)."""
    if dtype in HALF or mixed_precision in HALF:
        return max(HALF_FLOOR, HALF_RELATIVE * scale)
    if quantized:
        return 2e-2
    return 1e-4


def tolerance_rule(dtype: str, quantized: bool = False, mixed_precision: str = "no") -> str:
    """What :func:`tolerance` allows for this compute precision, in a few words for messages."""
    if dtype in HALF or mixed_precision in HALF:
        how = f"train.mixed_precision={mixed_precision}" if mixed_precision in HALF else f"model.dtype={dtype}"
        return (f"half-precision compute ({how}): max({HALF_FLOOR:g}, 1/{round(1 / HALF_RELATIVE)} of the largest "
                "|logit|), for 16-bit roundings that differ between devices and kernels")
    return "4-bit kernels" if quantized else "float32 compute"


def check_output(out: Path, sources: list[Path], overwrite: bool) -> None:
    """Refuse an ``out`` that overlaps a source or a protected place, or that holds anything but an earlier merge."""
    target = out.resolve()
    for source in sources:
        source = source.resolve()
        if target == source or source in target.parents or target in source.parents:
            raise RunDirError(f"-o {out}: overlaps the source {source}; write the merged model somewhere else, "
                              "e.g. -o runs/<name>-merged")
    rundir.check_location(out, sources)
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise RunDirError(f"{out} exists; pass --overwrite to replace a model an earlier merge wrote there, or "
                              "choose another -o")
        rundir.check_replaceable_export(out)


def merge(target: Path, out: Path, overwrite: bool = False, trust_remote_code: bool = False,
          log: Any = print) -> dict[str, Any]:
    """Merge the adapter of ``target`` (a LoRA run, its final/ or an adapter checkpoint) into its base at ``out``."""
    from finetune.checkpoint import forbid_unpickling
    from finetune.evaluation import open_target

    forbid_unpickling()
    run_dir = rundir.enclosing_run(target)
    lock = rundir.RunLock.acquire(run_dir, f"finetune merge {target}") if run_dir else contextlib.nullcontext()
    with lock:
        where, cfg = open_target(target, [], trust_remote_code)
        if cfg.peft.method == "none" or where.full_model is not None:
            raise RunDirError(f"{target}: not a LoRA run or adapter (peft.method is {cfg.peft.method}); nothing to "
                              "merge")
        check_output(out, [p for p in (target, where.recipe.parent, run_dir) if p is not None], overwrite)
        outputs.check_not_input(out, outputs.recipe_inputs(cfg))  # the base model (model.path) above all
        return _merge(where, cfg, out, log)


def _merge(where: Any, cfg: Any, out: Path, log: Any) -> dict[str, Any]:
    import torch
    import transformers
    from safetensors.torch import load_file

    from finetune import registry
    from finetune.checkpoint import export_manifest
    from finetune.data import load_splits
    from finetune.evaluation import load_model
    from finetune.modeling import build_tokenizer, save_tokenizer
    from finetune.probe import forward_precision, scale_of

    row = registry.recipe_row(cfg)
    tokenizer = build_tokenizer(cfg.model, row, source=str(where.adapter) if where.adapter else None)
    labels = load_splits(cfg.data, tokenizer, need_train=False).labels if row.task == "classification" else None
    model = load_model(cfg, where, labels).eval()
    check_file = where.recipe.parent / rundir.MERGE_CHECK
    reference = load_file(str(check_file)) if check_file.is_file() else None
    probe = _probe(reference, tokenizer)
    quantized, mixed = cfg.peft.method == "qlora", cfg.train.mixed_precision
    precision = forward_precision(mixed, next(model.parameters()).device)  # every forward: as training ran
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = rundir.scratch_dir(out)  # (stale scratch of a killed merge is removed first)
    try:
        with torch.no_grad(), precision.autocast():
            live = model(**probe).logits.float()
            scale = scale_of(live if reference is None else reference["logits"])
            tol = tolerance(cfg.model.dtype, quantized, mixed, scale)
            report: dict[str, Any] = {"tolerance": tol, "probe_tokens": int(probe["attention_mask"].sum())}
            if reference is not None:
                report["adapter_vs_recorded"] = float((live - reference["logits"]).abs().max())
            if cfg.peft.method == "qlora":  # merge into the full-precision base; report the 4-bit gap
                quantized_live = live
                model = load_model(cfg, where, labels, quantized=False).eval()
                live = model(**probe).logits.float()
                report["quantization_gap"] = float((live - quantized_live).abs().max())
            merged = model.merge_and_unload()
            merged.save_pretrained(tmp, safe_serialization=True)
            save_tokenizer(tokenizer, tmp)
            plain = yaml.safe_load(to_yaml(cfg))
            plain["peft"] = {"method": "none"}  # the merged model is a full model: evaluate it as one
            (tmp / rundir.RESOLVED).write_text(yaml.safe_dump(plain, sort_keys=False))
            reloaded = getattr(transformers, row.auto_class).from_pretrained(tmp).eval()
            report["merged_vs_adapter"] = float((reloaded(**probe).logits.float() - live).abs().max())
        bad = {k: v for k, v in report.items() if k.endswith(("_recorded", "_adapter")) and not v <= tol}
        if bad:
            raise MergeCheckError(f"merge check failed: max |delta logit| {bad} > tolerance {tol:g} "
                                  f"({tolerance_rule(cfg.model.dtype, quantized, mixed)}); nothing written (a "
                                  "tampered or mismatched adapter, or a different base model)")
        rundir.write_manifest(tmp, export_manifest(None, where.step))
        rundir.publish(tmp, out, rundir.scratch_dir(out, "old"))
    finally:
        if tmp.exists():
            rundir.remove_scratch(tmp)
    dequantized = (f" (QLoRA: merged into the full-precision base, not the 4-bit training copy; max |delta logit| "
                   f"4-bit vs full precision {report['quantization_gap']:.2e})") if cfg.peft.method == "qlora" else ""
    checks = ", ".join(f"{k} {v:.2e}" for k, v in report.items() if k.endswith(("_recorded", "_adapter")))
    log(f"merged {where.adapter or where.checkpoint} into {row.name} base -> {out}{dequantized}")
    log(f"merge check passed: max |delta logit| {checks} (tolerance {tol:g}: "
        f"{tolerance_rule(cfg.model.dtype, quantized, mixed)}; {report['probe_tokens']} tokens)")
    if reference is None:
        log("note: no merge_check.safetensors recorded with this adapter; only the merge itself was verified")
    return report


def _probe(reference: dict[str, Any] | None, tokenizer: Any) -> dict[str, Any]:
    """The recorded probe inputs, or a fixed sentence when the adapter came without a record."""
    if reference is not None:
        return {"input_ids": reference["input_ids"], "attention_mask": reference["attention_mask"]}
    encoded = tokenizer(["The quick brown fox jumps over the lazy dog."], return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
