"""Restored state is checked, not trusted: what a resume reads back must agree with the manifest and with itself.

A checkpoint's files are hashed into its manifest, but whoever can write the folder can re-hash it: a forged
``train_state.json`` (step 999999, or samples_seen -64) once trained nothing, or trained on a shifted data cursor,
and exited 0. Before a resume loads anything, :func:`check` compares the loop's counters with the manifest's step
and samples, the folder's name, each other, the scheduler's step count and the loss scale, and refuses the
checkpoint in one line when any of them disagrees. No torch here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from finetune import rundir
from finetune.errors import RunDirError
from finetune.state import TrainState

COUNTERS = ("step", "micro_step", "epoch", "samples_seen", "train_size", "tokens_seen")  # non-negative ints


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def problems(name: str, manifest: dict[str, Any], state: Any, scheduler: Any = None,
             scaler: Any = None) -> list[str]:
    """What is wrong with the restored ``state`` (train_state.json) of checkpoint folder ``name`` given its
    ``manifest`` and, when the checkpoint holds them, the ``scheduler`` and ``scaler`` state dicts; empty if all
    agree."""
    if not isinstance(state, dict):
        return [f"{rundir.TRAIN_STATE} is not a mapping"]
    expected = {f.name for f in fields(TrainState)}
    if set(state) != expected:
        odd = sorted(set(state) ^ expected)
        return [f"{rundir.TRAIN_STATE} has other keys than the loop's counters ({', '.join(odd)})"]
    found = [f"{key} is {state[key]!r}, not a count" for key in COUNTERS
             if not _is_int(state[key]) or state[key] < 0]
    if not _is_number(state["elapsed_s"]) or not math.isfinite(state["elapsed_s"]) or state["elapsed_s"] < 0:
        found.append(f"elapsed_s is {state['elapsed_s']!r}")
    if not _is_number(state["best_eval_loss"]) or math.isnan(state["best_eval_loss"]):
        found.append(f"best_eval_loss is {state['best_eval_loss']!r}")
    if found:
        return found
    step, samples = state["step"], state["samples_seen"]
    if step != manifest.get("step") or samples != manifest.get("samples_seen"):
        found.append(f"step {step} / samples_seen {samples}, but the manifest says step {manifest.get('step')} / "
                     f"samples_seen {manifest.get('samples_seen')}")
    named = re.fullmatch(r"step-(\d+)", name)
    if named and int(named.group(1)) != step:
        found.append(f"step {step} in a folder named {name}")
    if state["micro_step"] < step or samples < step:
        found.append(f"{step} steps from {state['micro_step']} micro-steps and {samples} samples (each step takes at "
                     "least one of each)")
    if state["train_size"] > 0 and state["epoch"] != samples // state["train_size"]:
        found.append(f"epoch {state['epoch']}, but {samples} samples of a {state['train_size']}-row data set are "
                     f"epoch {samples // state['train_size']}")
    last = scheduler.get("last_epoch") if isinstance(scheduler, dict) else None
    if last is not None and last != step:
        found.append(f"the scheduler has taken {last!r} steps, the loop {step}")
    scale = scaler.get("scale") if isinstance(scaler, dict) else None
    if scale is not None and not (_is_number(scale) and math.isfinite(scale) and scale > 0):
        found.append(f"the loss scale is {scale!r}")
    return found


def check(ckpt: Path, scheduler: Any = None, scaler: Any = None) -> None:
    """Refuse, in one line, a checkpoint whose restored state disagrees (see :func:`problems`)."""
    manifest = rundir.read_manifest(ckpt)
    try:
        state = json.loads((ckpt / rundir.TRAIN_STATE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RunDirError(f"{ckpt}: {rundir.TRAIN_STATE} cannot be loaded ({type(exc).__name__}); it was altered or "
                          "is corrupted: resume from another checkpoint (finetune ls lists them)") from None
    found = problems(ckpt.name, manifest, state, scheduler, scaler)
    if found:
        raise RunDirError(f"{ckpt}: its restored state does not agree ({'; '.join(found)}); it was altered or is "
                          "corrupted, so it is not resumed: resume from another checkpoint (finetune ls lists them)")
