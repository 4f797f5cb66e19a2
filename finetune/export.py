"""``finetune export RUN [--from step-N] -o DIR``: any checkpoint of a run as a Hugging Face folder, verified.

Whatever backend and world size wrote the checkpoint (single/DDP safetensors, FSDP1/2 DCP shards, DeepSpeed ZeRO
partitions; full or LoRA), the export runs in this ONE process on the CPU, without a process group:

1. the checkpoint (the newest resumable one, or ``--from``) is verified completely (run id, sha256 of every file)
   before anything in it is read, and ``-o`` is checked (never the run dir or anything in it, never a folder
   finetune did not write);
2. the model its own recipe builds (plus the adapter for LoRA runs) gets the checkpoint's weights through
   :mod:`finetune.portable` (:func:`finetune.evaluation.load_model`);
3. it is written to a fresh hidden ``.tmp`` folder beside ``DIR``: safetensors + config (or a PEFT adapter and
   ``merge_check.safetensors`` for LoRA runs), the tokenizer, the checkpoint's resolved recipe;
4. a FRESH process (``python -m finetune.reload``) loads that folder as any user would (``from_pretrained``; base +
   adapter for LoRA) and computes its logits on the probe the checkpoint recorded (:mod:`finetune.probe`), under
   the recipe's ``train.mixed_precision`` as training computed them; they must equal the recorded ones within the
   tolerance of that compute precision (:func:`finetune.probe.tolerance` says what it allows). A checkpoint
   written before probes existed is loaded back the same way and compared with this process's model instead
   (noted: not verified by logits);
5. only then the manifest (with the verification) is written and the folder becomes ``DIR``; a failed check
   publishes nothing (:class:`finetune.probe.ProbeMismatch`, exit code 1).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from finetune import layout, outputs, rundir
from finetune.errors import FinetuneError, RunDirError

RELOAD_MODULE = "finetune.reload"  # what the fresh process runs


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote: where, from which checkpoint, and how it was verified."""

    out: Path
    checkpoint: Path
    step: int | None
    kind: str  # "model" (a full model) | "adapter" (a PEFT adapter)
    delta: float  # the largest |delta logit| of the fresh process's logits
    tolerance: float
    recorded: bool  # compared with the checkpoint's recorded probe (False: with this process's model)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def locate(target: Path, name: str | None) -> tuple[Path, str | None]:
    """The run directory and the checkpoint name: ``target`` is a run dir (``name`` from ``--from``), or a
    checkpoint folder of one (then it is the checkpoint, and ``--from`` must not name another)."""
    if not target.is_dir():
        raise RunDirError(f"{target}: not a run directory (no such folder); give a run dir, e.g. runs/<name>")
    if (target / rundir.TRAIN_STATE).is_file() and target.parent.name == rundir.CHECKPOINTS:
        if name is not None and name not in (target.name, str(target)):
            raise RunDirError(f"{target} is a checkpoint and --from names {name}; give the run dir with --from, or "
                              "the checkpoint alone")
        return target.parent.parent, str(target)
    return target, name


def check_output(out: Path, run_dir: Path, overwrite: bool) -> None:
    """Refuse an ``-o`` that is or lies in a run directory (this one, its checkpoints, or any other), contains the
    run, is a protected place (see :func:`finetune.rundir.check_location`), or holds anything but an earlier export
    (that one is replaced only with ``overwrite``)."""
    target, run = out.resolve(), run_dir.resolve()
    if target == run or run in target.parents:
        raise RunDirError(f"-o {out}: lies inside the run {run_dir}, which is finetune's alone; write the export "
                          f"somewhere else, e.g. -o {run_dir.name}-export")
    if target in run.parents:
        raise RunDirError(f"-o {out}: contains the run {run_dir}; write the export somewhere else, e.g. "
                          f"-o {run_dir.name}-export")
    other = rundir.enclosing_run(target)
    if other is not None:
        raise RunDirError(f"-o {out}: is or lies inside the run {other}, which is finetune's alone; write the export "
                          "somewhere else")
    rundir.check_location(out, [run_dir])
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise RunDirError(f"-o {out} exists; pass --overwrite to replace an export finetune wrote there, or "
                              "choose another -o")
        rundir.check_replaceable_export(out)


def export(target: Path, name: str | None, out: Path, overwrite: bool = False, trust_remote_code: bool = False,
           log: Callable[[str], None] = _stderr) -> Exported:
    """Export checkpoint ``name`` (None: the newest resumable one) of run ``target`` to ``out``; see the module
    docstring. Progress goes to ``log`` (stderr)."""
    from finetune import checkpoint, probe
    from finetune.evaluation import Target, recipe_of

    checkpoint.forbid_unpickling()
    run_dir, name = locate(target, name)
    run_id = rundir.run_id(run_dir)
    info = _find(run_dir, name)
    check_output(out, run_dir, overwrite)
    with _pruned_is_said(info.path, run_dir):
        manifest = checkpoint.verify(info.path, run_id)
        recorded = probe.read(info.path)
        cfg = recipe_of(info.path / rundir.RESOLVED, [], trust_remote_code)
    outputs.check_not_input(out, outputs.recipe_inputs(cfg))
    where = Target(info.path / rundir.RESOLVED, checkpoint=info.path, step=info.step,
                   backend=layout.of(manifest).backend)
    log(f"loading {info.path.name} of {run_dir} ({layout.of(manifest).describe()}) ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = rundir.scratch_dir(out)  # (stale scratch of a killed export is removed first)
    scratch = rundir.scratch_dir(out, "check")
    try:
        with _pruned_is_said(info.path, run_dir):
            kind, labels, expected = _write(cfg, where, manifest, recorded, tmp, log)
        quantized, mixed = cfg.peft.method == "qlora", cfg.train.mixed_precision
        tol = probe.tolerance(cfg.model.dtype, mixed, where.backend or "single", quantized,
                              probe.scale_of(expected.logits))
        log(f"verifying {out}: loading it in a fresh process ...")
        got = reload_logits(tmp, expected.inputs, labels, trust_remote_code, scratch, mixed)
        delta = probe.max_delta(got, expected.logits)
        against = "the logits recorded at the checkpoint" if expected.recorded else "this process's model"
        if not delta <= tol:
            from finetune.merge import tolerance_rule

            raise probe.ProbeMismatch(
                f"export check failed: {info.path.name} reloaded from its export gives logits up to {delta:.2e} away "
                f"from {against} (tolerance {tol:g}: {tolerance_rule(cfg.model.dtype, quantized, mixed)}); nothing "
                f"was written to {out}: this checkpoint was not read correctly, please report it")
        if not expected.recorded:
            log(f"note: {info.path.name} recorded no probe logits (written before finetune recorded them): the "
                "export was loaded back in a fresh process but not verified against the training run's logits")
        verified = {"against": "recorded probe" if expected.recorded else "exporting process",
                    "fresh_process": True, "max_abs_logit_delta": delta, "tolerance": tol,
                    "probe_tokens": expected.tokens}
        source = {"checkpoint": str(info.path.resolve()), "layout": asdict(layout.of(manifest))}
        rundir.write_manifest(tmp, {**checkpoint.export_manifest(run_id, info.step), "source": source,
                                    "verified": verified})
        if out.is_dir() and any(out.iterdir()):  # again: something may have been put there meanwhile
            rundir.check_replaceable_export(out)
        rundir.publish(tmp, out, rundir.scratch_dir(out, "old"))
    finally:
        for folder in (tmp, scratch):
            if folder.exists():
                rundir.remove_scratch(folder)
    return Exported(out, info.path, info.step, kind, delta, tol, expected.recorded)


@contextlib.contextmanager
def _pruned_is_said(ckpt: Path, run_dir: Path) -> Iterator[None]:
    """A checkpoint deleted while this export reads it (a live run's keep_last pruned it) is said to be so, in one
    line, instead of whatever file it lacked first ("recipe file not found", a missing manifest)."""
    try:
        yield
    except (FinetuneError, OSError):
        if ckpt.is_dir():
            raise
        raise RunDirError(f"{ckpt.name} of {run_dir} was pruned (deleted, e.g. by the run's checkpoint.keep_last) "
                          f"while this export read it; export a newer one (`finetune ls {run_dir}` lists them)") \
            from None


def _find(run_dir: Path, name: str | None) -> Any:
    """The checkpoint to export: ``name`` (a name in checkpoints/ or a path), else the newest resumable one."""
    from finetune import checkpoint

    if name is None and checkpoint.latest_resumable(run_dir) is None:
        broken = [f"{p.name}: {checkpoint.inspect(p).reason}" for p in rundir.checkpoint_dirs(run_dir)]
        detail = f" ({'; '.join(broken)})" if broken else ""
        raise RunDirError(f"{run_dir}: no complete checkpoint to export{detail}; `finetune ls {run_dir}` lists them")
    return checkpoint.find(run_dir, name)


def _write(cfg: Any, where: Any, manifest: dict[str, Any], recorded: Any, folder: Path,
           log: Callable[[str], None]) -> tuple[str, Any, Any]:
    """Build the checkpoint's model, write it to ``folder`` (model or adapter, tokenizer, recipe, merge check);
    return its kind, the classification labels it was built with, and the logits the reload must reproduce."""
    import torch
    from safetensors.torch import save_file

    from finetune import peft as lora
    from finetune import probe, registry
    from finetune.backends import _unwrap_without_importing_deepspeed
    from finetune.checkpoint import tokenizer_fingerprint
    from finetune.data import load_splits
    from finetune.errors import NonFiniteError
    from finetune.evaluation import load_model
    from finetune.modeling import build_tokenizer, save_tokenizer

    row = registry.recipe_row(cfg)
    tokenizer = build_tokenizer(cfg.model, row)  # a checkpoint holds none: the one its recipe names
    if tokenizer_fingerprint(tokenizer) != manifest.get("tokenizer_sha256"):
        log(f"warning: the tokenizer its recipe names differs now from the one {where.checkpoint.name} was trained "
            "with; the export carries today's")
    labels = load_splits(cfg.data, tokenizer, need_train=False).labels if row.task == "classification" else None
    model = load_model(cfg, where, labels).eval()
    if not all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point()):
        raise NonFiniteError(f"{where.checkpoint}: its weights hold inf or nan; nothing was exported")
    expected = recorded
    if expected is None:  # no record: the reload must reproduce this process's model
        inputs = probe.fixed_inputs(tokenizer)
        expected = probe.Probe(inputs["input_ids"], inputs["attention_mask"],
                               probe.logits_of(model, inputs, cfg.train.mixed_precision), recorded=False)
    adapter = lora.enabled(cfg.peft)
    log(f"writing the {'adapter' if adapter else 'model'} of {where.checkpoint.name} ...")
    _unwrap_without_importing_deepspeed()  # else save_pretrained's unwrap imports DeepSpeed: seconds and a stray line
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    (folder / rundir.RESOLVED).write_bytes((where.checkpoint / rundir.RESOLVED).read_bytes())
    if adapter and recorded is not None:  # as final/: what `finetune merge` of this adapter checks against
        save_file(recorded.tensors(), str(folder / rundir.MERGE_CHECK))
    return ("adapter" if adapter else "model"), labels, expected


def reload_logits(folder: Path, inputs: dict[str, Any], labels: list[str] | None, trust_remote_code: bool,
                  scratch: Path, mixed_precision: str) -> Any:
    """The logits of the export in ``folder``, loaded in a fresh Python process (``python -m finetune.reload``), on
    ``inputs``, computed under ``mixed_precision`` autocast (the training precision); ``scratch`` (outside the
    export) carries the inputs and the logits as safetensors."""
    from safetensors.torch import load_file, save_file

    from finetune import probe

    scratch = scratch.resolve()  # the child runs in scratch: a relative path (-o q-100) would name another file
    given, got = scratch / "inputs.safetensors", scratch / "logits.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(given))
    # -P: the child's sys.path never starts with its working folder (no module planted there is imported)
    argv = [sys.executable, "-P", "-m", RELOAD_MODULE, str(folder.resolve()), "--inputs", str(given),
            "--output", str(got), "--mixed-precision", mixed_precision]
    argv += ["--labels", json.dumps(labels)] if labels is not None else []
    argv += ["--trust-remote-code"] if trust_remote_code else []
    package_root = str(Path(__file__).resolve().parents[1])  # the child runs this very finetune, from any cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not got.is_file():
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1] if lines else "")
        raise probe.ProbeMismatch(f"export check failed: the export does not load in a fresh process (exit "
                                  f"{done.returncode}: {reason.removeprefix('error: ')[:300]}); nothing was written")
    return load_file(str(got))["logits"]
