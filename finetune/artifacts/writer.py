"""The one writer of a model folder: build -> save to a ``.tmp`` folder -> verify -> publish.

Every model folder finetune writes goes through :func:`write`: a run's ``final/`` (:mod:`finetune.artifacts.final`),
``finetune export`` and the scratch export ``finetune eval`` evaluates a checkpoint through
(:func:`write_checkpoint`), and ``finetune merge``. The steps, in order:

1. save: the caller's ``save(folder)`` writes the model (or adapter), tokenizer and recipe into a fresh ``.tmp``
   folder beside the destination (:func:`finetune.storage.rundir.scratch_dir`, or the run dir's ``final.tmp``);
2. verify: weights that are not all finite are never written (:func:`all_finite`, the one check); with a
   :class:`Check`, a FRESH process (``python -m finetune.artifacts.reload``) loads the folder as any user would and
   computes its logits on the probe inputs (the ones the checkpoint recorded, else
   :func:`finetune.artifacts.probe.fixed_inputs`) under the recipe's ``train.mixed_precision``; they must equal the
   expected logits within :func:`finetune.artifacts.probe.tolerance` (the caller's one-line error otherwise: nothing is
   published);
3. publish: the manifest (with the verification) is written last and the folder is renamed into place
   (:func:`finetune.storage.rundir.publish`, which owns every name and deletion in a run dir); a failure at any step
   removes the scratch folders and leaves any previous folder where it was.

Nothing here imports a command module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import __version__
from finetune.artifacts import probe
from finetune.artifacts.probe import Probe, ProbeMismatch
from finetune.artifacts.target import Target, load_model
from finetune.backends import unwrap_without_importing_deepspeed
from finetune.config import RecipeConfig
from finetune.errors import FinetuneError, NonFiniteError
from finetune.runtime import peft as lora
from finetune.storage import rundir
from finetune.storage.checkpoints import tokenizer_fingerprint
from finetune.storage.record import record

RELOAD_MODULE = "finetune.artifacts.reload"  # what the fresh process runs


def all_finite(state_dict: dict[str, Any] | None) -> bool:
    """Whether every floating-point tensor of ``state_dict`` is finite (the one finite-weight check)."""
    import torch  # lazy: heavy

    return all(bool(torch.isfinite(t).all()) for t in (state_dict or {}).values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def export_manifest(run_id: str | None, step: int | None) -> dict[str, Any]:
    """The manifest head of an export (``final/``, ``finetune export`` or ``finetune merge``); the inventory is
    added on write."""

    return {"kind": "export", "run_id": run_id, "step": step, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "finetune": __version__}


@dataclass(frozen=True)
class Check:
    """How a written folder is verified: a fresh process must reproduce ``expected`` (the probe inputs and the
    logits on them) within ``tolerance``; ``mismatch(delta)`` is the caller's one-line error when it does not."""

    expected: Probe
    tolerance: float
    labels: list[str] | None
    mixed_precision: str
    trust_remote_code: bool
    mismatch: Callable[[float], FinetuneError]
    against: str  # what the expected logits are, for the manifest ("recorded probe", ...)


def write(out: Path, save: Callable[[Path], None], manifest: dict[str, Any], *, check: Check | None = None,
          weights: dict[str, Any] | None = None, nonfinite: str = "", tmp: Path | None = None,
          old: Path | None = None, recheck_out: bool = False) -> float | None:
    """Save with ``save(folder)`` into a scratch folder, verify, and publish it at ``out``; see the module docstring.

    ``weights``: the state dict whose finiteness is checked first (NonFiniteError ``nonfinite``; None: the caller
    checked it, e.g. collectively across ranks). ``tmp``/``old``: the scratch and previous-folder names (default:
    :func:`finetune.storage.rundir.scratch_dir` beside ``out``). ``recheck_out``: check again, just before publishing,
    that what is at ``out`` may be replaced (something may have been put there meanwhile). Returns the verified max
    |delta logit| (None without a check)."""
    if weights is not None and not all_finite(weights):
        raise NonFiniteError(nonfinite)
    out.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        tmp = rundir.scratch_dir(out)  # (stale scratch of a killed command is removed first)
    elif tmp.exists():
        rundir.remove_scratch(tmp)
    scratch = rundir.scratch_dir(out, "check") if check is not None else None
    try:
        save(tmp)
        delta = None
        if check is not None:
            assert scratch is not None
            got = reload_logits(tmp, check.expected.inputs, check.labels, check.trust_remote_code, scratch,
                                check.mixed_precision)
            delta = probe.max_delta(got, check.expected.logits)
            if not delta <= check.tolerance:
                raise check.mismatch(delta)
            manifest = {**manifest, "verified": {"against": check.against, "fresh_process": True,
                                                 "max_abs_logit_delta": delta, "tolerance": check.tolerance,
                                                 "probe_tokens": check.expected.tokens}}
        rundir.write_manifest(tmp, manifest)
        if recheck_out and out.is_dir() and any(out.iterdir()):
            rundir.check_replaceable_export(out)
        rundir.publish(tmp, out, old if old is not None else rundir.scratch_dir(out, "old"))
    finally:
        for folder in (tmp, scratch):
            if folder is not None and folder.exists():
                rundir.remove_scratch(folder)
    return delta


def reload_logits(folder: Path, inputs: dict[str, Any], labels: list[str] | None, trust_remote_code: bool,
                  scratch: Path, mixed_precision: str) -> Any:
    """The logits of the model folder ``folder``, loaded in a fresh Python process (``python -m
    finetune.artifacts.reload``),
    on ``inputs``, computed under ``mixed_precision`` autocast (the training precision); ``scratch`` (outside the
    folder) carries the inputs and the logits as safetensors."""
    from safetensors.torch import load_file, save_file  # lazy: heavy

    scratch = scratch.resolve()  # the child runs in scratch: a relative path (-o q-100) would name another file
    given, got = scratch / "inputs.safetensors", scratch / "logits.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(given))
    # -P: the child's sys.path never starts with its working folder (no module planted there is imported)
    argv = [sys.executable, "-P", "-m", RELOAD_MODULE, str(folder.resolve()), "--inputs", str(given),
            "--output", str(got), "--mixed-precision", mixed_precision]
    argv += ["--labels", json.dumps(labels)] if labels is not None else []
    argv += ["--trust-remote-code"] if trust_remote_code else []
    package_root = str(Path(__file__).resolve().parents[2])  # the child runs this very finetune, from any cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not got.is_file():
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1] if lines else "")
        raise ProbeMismatch(f"export check failed: the export does not load in a fresh process (exit "
                            f"{done.returncode}: {reason.removeprefix('error: ')[:300]}); nothing was written")
    return load_file(str(got))["logits"]


@dataclass(frozen=True)
class Written:
    """What :func:`write_checkpoint` wrote and how it was verified."""

    kind: str  # "model" (a full model) | "adapter" (a PEFT adapter)
    delta: float  # the largest |delta logit| of the fresh process's logits
    tolerance: float
    expected: Probe  # recorded: compared with the checkpoint's recorded probe (else with this process's model)


def write_checkpoint(cfg: RecipeConfig, where: Target, out: Path, *, trust_remote_code: bool,
                     log: Callable[[str], None], mismatch: Callable[[float, float, str, bool], FinetuneError],
                     manifest: dict[str, Any], recheck_out: bool = False) -> Written:
    """A verified checkpoint ``where`` as a Hugging Face folder at ``out`` (``finetune export``, and the scratch
    export ``finetune eval`` of a checkpoint evaluates): its recipe's model (plus the adapter for LoRA runs) with
    the checkpoint's weights, the tokenizer its recipe names, its recipe, and for an adapter the merge check, written
    by :func:`write` and verified against the logits the checkpoint recorded (a checkpoint written before probes
    existed: against this process's model on :func:`finetune.artifacts.probe.fixed_inputs`). ``mismatch(delta,
    tolerance, rule, recorded)`` is the caller's error for a failed check; ``manifest``: the head of the folder's
    manifest (the row and labels are added)."""
    from finetune.runtime.modeling import build_tokenizer, save_tokenizer  # imports torch

    assert where.checkpoint is not None and where.row is not None
    recorded = probe.read(where.checkpoint)  # a damaged record is refused before the weights are read
    tokenizer = build_tokenizer(cfg.model, where.row)  # a checkpoint holds none: the one its recipe names
    if tokenizer_fingerprint(tokenizer) != where.manifest.get("tokenizer_sha256"):
        log(f"warning: the tokenizer its recipe names differs now from the one {where.checkpoint.name} was trained "
            "with; the export carries today's")
    model = load_model(cfg, where).eval()
    weights = model.state_dict()
    expected = recorded
    if expected is None:  # no record: the reload must reproduce this process's model
        inputs = probe.fixed_inputs(tokenizer)
        expected = Probe(inputs["input_ids"], inputs["attention_mask"],
                         probe.logits_of(model, inputs, cfg.train.mixed_precision), recorded=False)
    adapter = lora.enabled(cfg.peft)
    quantized, mixed = cfg.peft.method == "qlora", cfg.train.mixed_precision
    tol = probe.tolerance(cfg.model.dtype, mixed, where.backend or "single", quantized, probe.scale_of(expected.logits))
    rule = probe.tolerance_rule(cfg.model.dtype, quantized, mixed)

    def save(folder: Path) -> None:
        log(f"writing the {'adapter' if adapter else 'model'} of {where.checkpoint.name} ...")
        unwrap_without_importing_deepspeed()  # else save_pretrained's unwrap imports DeepSpeed: seconds, a stray line
        model.save_pretrained(folder, safe_serialization=True)
        save_tokenizer(tokenizer, folder)
        (folder / rundir.RESOLVED).write_bytes(where.recipe.read_bytes())
        if adapter and recorded is not None:  # as final/: what `finetune merge` of this adapter checks against
            from safetensors.torch import save_file  # lazy: heavy

            save_file(recorded.tensors(), str(folder / rundir.MERGE_CHECK))
        log(f"verifying {out}: loading it in a fresh process ...")

    check = Check(expected, tol, where.labels, mixed, trust_remote_code,
                  lambda delta: mismatch(delta, tol, rule, expected.recorded),
                  "recorded probe" if expected.recorded else "exporting process")
    delta = write(out, save, {**manifest, **record(cfg, where.row, where.labels)}, check=check, weights=weights,
                  nonfinite=f"{where.checkpoint}: its weights hold inf or nan; nothing was exported",
                  recheck_out=recheck_out)
    assert delta is not None
    return Written("adapter" if adapter else "model", delta, tol, expected)
