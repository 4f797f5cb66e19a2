"""``finetune merge``: base + LoRA adapter -> a plain Hugging Face model, verified before it is kept.

The check compares logits on the probe inputs (the ones recorded with the adapter, else
:func:`finetune.artifacts.probe.fixed_inputs`), each forward under the recipe's ``train.mixed_precision`` autocast (the
precision the adapter was trained and recorded in), within :func:`finetune.artifacts.probe.logit_tolerance`, two ways:
1. base + adapter (as loaded now) vs the reference the training run recorded in ``final/merge_check.safetensors``
   (catches a tampered or mismatched adapter, or a different base);
2. the merged model, saved and loaded back in a fresh process, vs base + adapter (catches a bad merge or save).
The merged model is written by the one writer (:func:`finetune.artifacts.writer.write`): to a fresh ``.tmp`` folder
beside ``<out>``, renamed only when every check passes, so a failed merge leaves nothing behind. ``-o`` may not
overlap the source (the adapter or its run), the source run is locked while it is read, and ``--overwrite``
replaces only a model an earlier merge wrote (its manifest lists every file). A QLoRA adapter is merged into the
full-precision (dequantized) base, and the output says so.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml

from finetune.artifacts import probe
from finetune.artifacts.checkpoint import forbid_unpickling
from finetune.artifacts.probe import logit_tolerance as tolerance  # the rule lives with the probe; named so here too
from finetune.artifacts.probe import tolerance_rule
from finetune.artifacts.target import Target, load_model, open_target
from finetune.artifacts.writer import Check, export_manifest, write
from finetune.config import RecipeConfig, outputs, to_yaml
from finetune.errors import FinetuneError, RunDirError
from finetune.storage import rundir
from finetune.storage.record import record


class MergeCheckError(FinetuneError):
    """The merged model does not reproduce the adapter's logits."""

    exit_code = 1


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
        return _merge(where, cfg, out, log, trust_remote_code)


def _merge(where: Target, cfg: RecipeConfig, out: Path, log: Any, trust_remote_code: bool) -> dict[str, Any]:
    import torch  # lazy: heavy
    from safetensors.torch import load_file  # lazy: heavy

    from finetune.runtime.modeling import build_tokenizer, save_tokenizer  # imports torch

    row = where.row
    assert row is not None
    tokenizer = build_tokenizer(cfg.model, row, source=str(where.adapter) if where.adapter else None)
    model = load_model(cfg, where).eval()
    check_file = where.recipe.parent / rundir.MERGE_CHECK
    reference = load_file(str(check_file)) if check_file.is_file() else None
    inputs = ({"input_ids": reference["input_ids"], "attention_mask": reference["attention_mask"]}
              if reference is not None else probe.fixed_inputs(tokenizer))
    quantized, mixed = cfg.peft.method == "qlora", cfg.train.mixed_precision
    live = probe.logits_of(model, inputs, mixed)  # every forward: as training ran
    scale = probe.scale_of(live if reference is None else reference["logits"])
    tol = tolerance(cfg.model.dtype, quantized, mixed, scale)
    rule = tolerance_rule(cfg.model.dtype, quantized, mixed)

    def failed(bad: dict[str, float]) -> MergeCheckError:
        return MergeCheckError(f"merge check failed: max |delta logit| {bad} > tolerance {tol:g} ({rule}); nothing "
                               "written (a tampered or mismatched adapter, or a different base model)")

    report: dict[str, Any] = {"tolerance": tol, "probe_tokens": int(inputs["attention_mask"].sum())}
    if reference is not None:
        report["adapter_vs_recorded"] = probe.max_delta(live, reference["logits"])
        if not report["adapter_vs_recorded"] <= tol:
            raise failed({"adapter_vs_recorded": report["adapter_vs_recorded"]})
    if cfg.peft.method == "qlora":  # merge into the full-precision base; report the 4-bit gap
        quantized_live = live
        model = load_model(cfg, where, quantized=False).eval()
        live = probe.logits_of(model, inputs, mixed)
        report["quantization_gap"] = probe.max_delta(live, quantized_live)
    with torch.no_grad():
        merged = model.merge_and_unload()

    def save(folder: Path) -> None:
        merged.save_pretrained(folder, safe_serialization=True)
        save_tokenizer(tokenizer, folder)
        plain = yaml.safe_load(to_yaml(cfg))
        plain["peft"] = {"method": "none"}  # the merged model is a full model: evaluate it as one
        (folder / rundir.RESOLVED).write_text(yaml.safe_dump(plain, sort_keys=False))

    expected = probe.Probe(inputs["input_ids"], inputs["attention_mask"], live, recorded=False)
    check = Check(expected, tol, where.labels, mixed, trust_remote_code,
                  lambda delta: failed({"merged_vs_adapter": delta}), "base + adapter")
    report["merged_vs_adapter"] = write(
        out, save, {**export_manifest(None, where.step), **record(cfg, row, where.labels)}, check=check,
        weights=merged.state_dict(), nonfinite=f"{where.adapter or where.checkpoint}: merged into its base, the "
        "weights hold inf or nan; nothing was written")
    dequantized = (f" (QLoRA: merged into the full-precision base, not the 4-bit training copy; max |delta logit| "
                   f"4-bit vs full precision {report['quantization_gap']:.2e})") if cfg.peft.method == "qlora" else ""
    checks = ", ".join(f"{k} {v:.2e}" for k, v in report.items() if k.endswith(("_recorded", "_adapter")))
    log(f"merged {where.adapter or where.checkpoint} into {row.name} base -> {out}{dequantized}")
    log(f"merge check passed: max |delta logit| {checks} (tolerance {tol:g}: {rule}; {report['probe_tokens']} tokens)")
    if reference is None:
        log("note: no merge_check.safetensors recorded with this adapter; only the merge itself was verified")
    return report
