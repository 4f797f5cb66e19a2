"""Restored state is checked, not trusted: what a resume reads back must agree with the manifest and with itself.

A checkpoint's files are hashed into its manifest, but whoever can write the folder can re-hash it: a forged
``train_state.json`` (step 999999, or samples_seen -64) once trained nothing, or trained on a shifted data cursor,
and exited 0. Before a resume loads anything, :func:`check` compares the loop's counters with the manifest's step
and samples, the folder's name and each other; the scheduler's and the loss scaler's states with the step and with
the ones this build made (no key a build does not have: ``load_state_dict`` copies every key into the object); and
every rank's RNG state, ours (JSON) and accelerate's (``random_states_<rank>.pkl``, loaded as data only, never
unpickled), with the manifest's world size and with what a generator accepts. Any disagreement refuses the
checkpoint in one line. torch and numpy are imported only by the RNG check (a generator is the judge of its state).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from finetune.errors import RunDirError
from finetune.storage import rundir
from finetune.storage.state import TrainState

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
    if scheduler is not None:
        found += scheduler_problems(scheduler, step)
    if scaler is not None:
        found += scaler_problems(scaler)
    return found


# Keys a scheduler's state must hold (LambdaLR's; torch versions add private flags, which a build names).
SCHEDULER_KEYS = frozenset({"base_lrs", "last_epoch", "_step_count", "_last_lr", "lr_lambdas"})
SCALER_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})


def _rates(value: Any) -> bool:
    return isinstance(value, list) and all(_is_number(v) and math.isfinite(v) and v >= 0 for v in value)


def scheduler_problems(restored: Any, step: int, built: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with a restored LambdaLR state after ``step`` optimizer steps, given the state this build's
    scheduler has (``built``; None: only what the state must say by itself)."""
    if not isinstance(restored, dict):
        return ["the scheduler's state is not a mapping"]
    keys, allowed = set(restored), SCHEDULER_KEYS | set(built or ())
    if not keys >= SCHEDULER_KEYS or keys - allowed:
        odd = sorted((SCHEDULER_KEYS - keys) | (keys - allowed))
        return [f"the scheduler's state has other keys than a scheduler's ({', '.join(odd)})"]
    found = []
    if restored["last_epoch"] != step or not _is_int(restored["last_epoch"]):
        found.append(f"the scheduler has taken {restored['last_epoch']!r} steps, the loop {step}")
    if restored["_step_count"] != step + 1 or not _is_int(restored["_step_count"]):
        found.append(f"the scheduler counts {restored['_step_count']!r} calls, not {step + 1} after step {step}")
    groups = len(built["base_lrs"]) if built is not None and isinstance(built.get("base_lrs"), list) else None
    for key in ("base_lrs", "_last_lr"):
        if not _rates(restored[key]) or (groups is not None and len(restored[key]) != groups):
            found.append(f"the scheduler's {key} is {restored[key]!r}, not {groups or 'its'} learning rates")
    lambdas = restored["lr_lambdas"]
    if not isinstance(lambdas, list) or any(v is not None for v in lambdas) or (
            groups is not None and len(lambdas) != groups):
        found.append(f"the scheduler's lr_lambdas is {lambdas!r} (a schedule is code: it is never restored)")
    for key in sorted(set(restored) - SCHEDULER_KEYS):  # torch's private flags
        if not isinstance(restored[key], bool):
            found.append(f"the scheduler's {key} is {restored[key]!r}, not a flag")
    return found


def scaler_problems(restored: Any, built: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with a restored loss-scaler state, given this build's (``built``: ``{}`` for bf16/fp32, whose
    scaler ignores what it is given; None: only what the state must say by itself)."""
    if not isinstance(restored, dict):
        return ["the loss scaler's state is not a mapping"]
    if not restored:
        return ["the loss scaler's state is empty, but this run scales its fp16 loss"] if built else []
    if set(restored) != SCALER_KEYS:
        odd = sorted(set(restored) ^ SCALER_KEYS)
        return [f"the loss scaler's state has other keys than a scaler's ({', '.join(odd)})"]
    found = []
    scale = restored["scale"]
    if not (_is_number(scale) and math.isfinite(scale) and scale > 0):
        found.append(f"the loss scale is {scale!r}")
    for key in ("growth_factor", "backoff_factor", "growth_interval"):  # settings, never changed by training
        if built and restored[key] != built.get(key):
            found.append(f"the loss scaler's {key} is {restored[key]!r}, this run's is {built.get(key)!r}")
    interval, tracker = restored["growth_interval"], restored["_growth_tracker"]
    if not _is_int(tracker) or not _is_int(interval) or not 0 <= tracker < max(interval, 1):
        found.append(f"the loss scaler's _growth_tracker is {tracker!r} (growth_interval {interval!r})")
    return found


# --- the logit probe ----------------------------------------------------------------------------------------------


def probe_problems(input_ids: Any, attention_mask: Any, logits: Any) -> list[str]:
    """What is wrong with a recorded logit probe (finetune.artifacts.probe: what an export must reproduce): the
    inputs are ``[rows, length]`` integer token ids and a 0/1 mask of that shape, the logits finite floats, either
    ``[rows, length, vocabulary]`` (a language model: every id below the vocabulary they span) or ``[rows, labels]``
    (a classifier's or reward model's scores). Empty when it is one that finetune records. A forged one otherwise
    reached the export's fresh process (an index error there, blamed on the export) or its comparison (a mismatch to
    "report"), exit 1 instead of a damaged checkpoint's one line."""
    import torch  # lazy: heavy

    if not all(isinstance(t, torch.Tensor) for t in (input_ids, attention_mask, logits)):
        return ["it holds no tensors"]
    whole = (torch.int64, torch.int32)
    if input_ids.dtype not in whole or input_ids.dim() != 2 or not input_ids.numel():
        return [f"its input_ids are {input_ids.dtype} of shape {tuple(input_ids.shape)}, not [rows, length] token ids"]
    rows, length = input_ids.shape
    if attention_mask.dtype not in (*whole, torch.bool) or tuple(attention_mask.shape) != (rows, length):
        return [f"its attention_mask is {attention_mask.dtype} of shape {tuple(attention_mask.shape)}, not "
                f"{rows} x {length} ones and zeros"]
    per_token = logits.dim() == 3 and tuple(logits.shape[:2]) == (rows, length)
    if not logits.is_floating_point() or not (per_token or (logits.dim() == 2 and logits.size(0) == rows)):
        return [f"its logits are {logits.dtype} of shape {tuple(logits.shape)}, not {rows} x {length} x vocabulary "
                f"(or {rows} x labels)"]
    found = []
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        found.append("its attention_mask holds values other than 0 and 1")
    vocabulary = logits.size(-1) if per_token else None
    if not bool((input_ids >= 0).all()) or (vocabulary and not bool((input_ids < vocabulary).all())):
        found.append(f"its input_ids hold token ids outside [0, {vocabulary or 'the vocabulary'})"
                     + (" (the vocabulary of its logits)" if vocabulary else ""))
    if not bool(torch.isfinite(logits).all()):
        found.append("its logits are not all finite numbers")
    return found


# --- RNG states ---------------------------------------------------------------------------------------------------

OURS = re.compile(r"rng_state_(\d+)\.json")  # finetune's, one per rank (JSON + safetensors)
ACCELERATE = re.compile(r"random_states_(\d+)\.pkl")  # accelerate's, one per rank (torch.save)


def rng_name(rank: int) -> str:
    """The name (without ``.json``) of rank ``rank``'s RNG state that finetune writes in a checkpoint."""
    return f"rng_state_{rank}"


def generator_problem(kind: str, value: Any) -> str | None:
    """Why ``value`` is not a state of RNG ``kind`` (python, numpy, torch, or an accelerator's list of generator
    states); None when a generator of that kind accepts it. A scratch generator is the judge: the live ones are not
    touched."""

    import numpy as np  # lazy: heavy
    import torch  # lazy: heavy

    try:
        if kind == "python":
            if not isinstance(value, tuple):
                return "not a tuple"
            random.Random().setstate(value)
        elif kind == "numpy":
            if not isinstance(value, tuple) or not isinstance(value[1], np.ndarray):
                return "not numpy's state tuple"
            np.random.RandomState().set_state(value)
        elif kind == "torch":
            if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
                return "not a byte tensor"
            torch.Generator().set_state(value)
        else:  # a device's generators: one byte tensor per device
            if not isinstance(value, list | tuple) or not all(
                    isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1 for v in value):
                return "not a list of byte tensors"
            if kind == "cuda" and torch.cuda.is_available() and value:
                size = torch.cuda.get_rng_state().numel()
                if any(v.numel() != size for v in value):
                    return f"not {size}-byte generator states"
    except (TypeError, ValueError, OverflowError, IndexError, KeyError, RuntimeError) as exc:
        return f"refused by a generator ({type(exc).__name__})"
    return None


def _entries(state: Any) -> str:
    return ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__


def _ours_problems(state: Any) -> list[str]:
    """finetune's RNG file (finetune.artifacts.checkpoint.rng_state): python, numpy, torch and, where present, cuda."""
    if not isinstance(state, dict) or not set(state) >= {"python", "numpy", "torch"} or set(state) - {
            "python", "numpy", "torch", "cuda"}:
        return [f"has other entries than python, numpy, torch and cuda ({_entries(state)})"]
    return [f"its {kind} state is {why}" for kind in sorted(state) if (why := generator_problem(kind, state[kind]))]


_ACCELERATE_KINDS = {"random_state": "python", "numpy_random_seed": "numpy", "torch_manual_seed": "torch"}


def _accelerate_problems(state: Any, micro_step: int, grad_accum: int | None) -> list[str]:
    """accelerate's RNG file: its generators, and its ``step`` (the micro-step count from which accelerate decides
    where a gradient-accumulation window ends: restored into the accelerator, a shifted one moves every window)."""
    if not isinstance(state, dict) or not {"step", *_ACCELERATE_KINDS} <= set(state):
        return [f"has not accelerate's entries ({_entries(state)})"]
    found = []
    for key in sorted(set(state) - {"step", "xm_seed"}):
        kind = _ACCELERATE_KINDS.get(key) or (key.removeprefix("torch_").removesuffix("_manual_seed")
                                              if key.startswith("torch_") and key.endswith("_manual_seed") else None)
        if kind is None:
            found.append(f"holds an unknown entry {key!r}")
        elif why := generator_problem(kind, state[key]):
            found.append(f"its {key} is {why}")
    if "xm_seed" in state and not _is_int(state["xm_seed"]):  # a TPU's generator: its seed
        found.append(f"its xm_seed is {state['xm_seed']!r}")
    step = state["step"]
    if not _is_int(step) or not 0 <= step <= micro_step or (grad_accum and step % grad_accum):
        found.append(f"its step is {step!r}, not a whole number of {grad_accum or '?'}-micro-step windows up to "
                     f"the loop's {micro_step} micro-steps")
    return found


def load_accelerate_rng(path: Path) -> Any:
    """accelerate's ``random_states_<rank>.pkl`` as data only (``weights_only``: tensors, numpy arrays and plain
    values; anything else, e.g. a planted payload, fails to load instead of running), as accelerate reads it."""
    from accelerate.utils import load  # lazy: heavy

    return load(path, map_location="cpu", weights_only=True)


def rng_problems(ckpt: Path, manifest: dict[str, Any], micro_step: int,
                 read: Callable[[Path, str], Any]) -> list[str]:
    """Every rank's RNG states (ours, read with ``read``, and accelerate's): one of each per rank of the manifest's
    world size, none for another rank, each a state its generators accept."""
    world = manifest.get("world_size")
    if not _is_int(world) or world < 1:
        return [f"the manifest's world_size is {world!r}"]
    names = [p.name for p in ckpt.iterdir()]
    found = []
    for pattern, what in ((OURS, "rng_state_<rank>.json"), (ACCELERATE, "random_states_<rank>.pkl")):
        ranks = sorted(int(m.group(1)) for n in names if (m := pattern.fullmatch(n)))
        if ranks != list(range(world)):
            found.append(f"{what} exists for ranks {ranks}, but the checkpoint was written by {world} process(es)")
    if found:
        return found
    gbs, mbs = manifest.get("global_batch_size"), manifest.get("micro_batch_size")
    grad_accum = gbs // (mbs * world) if _is_int(gbs) and _is_int(mbs) and mbs > 0 and gbs >= mbs * world else None
    for rank in range(world):
        ours, theirs = f"{rng_name(rank)}.json", f"random_states_{rank}.pkl"
        for name, load in ((ours, lambda r=rank: read(ckpt, rng_name(r))),
                           (theirs, lambda n=theirs: load_accelerate_rng(ckpt / n))):
            try:
                state = load()
            except Exception as exc:  # any failure to read it back is a refusal, in one line
                found.append(f"{name} cannot be loaded as data ({type(exc).__name__})")
                continue
            why = _ours_problems(state) if name.endswith(".json") else _accelerate_problems(state, micro_step,
                                                                                            grad_accum)
            found += [f"{name} {w}" for w in why]
    return found


def _disagrees(ckpt: Path, found: list[str]) -> RunDirError:
    """The one refusal line for a checkpoint whose restored state disagrees in the ways ``found`` lists."""
    return RunDirError(f"{ckpt}: its restored state does not agree ({'; '.join(found)}); it was altered or is "
                       "corrupted, so it is not resumed: resume from another checkpoint (finetune ls lists them)")


def read_train_state(ckpt: Path) -> dict[str, Any]:
    """The parsed ``train_state.json`` of checkpoint folder ``ckpt``, or one refusal line when it cannot be read as
    JSON (the counters themselves are judged by :func:`problems`). Every reader of it goes through here, so a damaged
    file is the same one line wherever it is met (resume's plan, the restore)."""
    try:
        state = json.loads((ckpt / rundir.TRAIN_STATE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RunDirError(f"{ckpt}: {rundir.TRAIN_STATE} cannot be loaded ({type(exc).__name__}); it was altered or "
                          "is corrupted: resume from another checkpoint (finetune ls lists them)") from None
    return state


def checked_train_state(ckpt: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """``train_state.json`` of ``ckpt`` once :func:`problems` finds nothing wrong with it against the manifest
    (``manifest``: already read, else read here); otherwise the one refusal line :func:`check` gives."""
    state = read_train_state(ckpt)
    found = problems(ckpt.name, rundir.read_manifest(ckpt) if manifest is None else manifest, state)
    if found:
        raise _disagrees(ckpt, found)
    return state


def check(ckpt: Path, read: Callable[[Path, str], Any] | None = None, built: dict[str, Any] | None = None,
          manifest: dict[str, Any] | None = None) -> None:
    """Refuse, in one line, a checkpoint whose restored state disagrees (see :func:`problems`, and with ``read``
    (finetune.storage.checkpoints.read_state) the scheduler, scaler and RNG states). ``built``: the state dicts of this
    build's ``scheduler`` and ``scaler`` (those named are required in the checkpoint). ``manifest``: the
    checkpoint's manifest when the caller has read it already (else read here)."""
    manifest = rundir.read_manifest(ckpt) if manifest is None else manifest
    state = checked_train_state(ckpt, manifest)  # its counters first: a refusal there stops the other checks
    found: list[str] = []
    if read is not None:
        for name, judge in (("scheduler", lambda s, b: scheduler_problems(s, state["step"], b)),
                            ("scaler", scaler_problems)):
            if name not in (built or {}):
                continue
            if not (ckpt / f"{name}.json").is_file():
                found.append(f"{name}.json is missing")
                continue
            try:
                restored = read(ckpt, name)
            except Exception as exc:  # any failure to read it back is a refusal, in one line
                found.append(f"{name}.json cannot be loaded as data ({type(exc).__name__})")
                continue
            found += judge(restored, (built or {})[name])
        found += rng_problems(ckpt, manifest, state["micro_step"], read)
    if found:
        raise _disagrees(ckpt, found)


def check_objects(ckpt: Path, objects: dict[str, Any], read: Callable[[Path, str], Any]) -> None:
    """Refuse, in one line naming the checkpoint and each file, what a checkpoint holds for the run's objects that
    judge it themselves, before anything loads: an object with ``restored_problems(held, counters)`` (GRPO's
    generation batch) gets its ``<name>.json`` read back with ``read`` (``held``; None when the checkpoint holds none)
    and the checked ``train_state.json`` counters, and returns what is wrong. A judge may raise a ConfigError of its
    own (a recipe changed under --allow-config-change that the object cannot follow)."""
    judges = {name: judge for name, obj in objects.items()
              if (judge := getattr(obj, "restored_problems", None)) is not None}
    if not judges:
        return
    counters = checked_train_state(ckpt)
    found: list[str] = []
    for name, judge in judges.items():
        held = None
        if (ckpt / f"{name}.json").is_file():
            try:
                held = read(ckpt, name)
            except Exception as exc:  # any failure to read it back is a refusal, in one line
                found.append(f"{name}.json cannot be loaded as data ({type(exc).__name__})")
                continue
        found += [f"{name}.json: {problem}" for problem in judge(held, counters)]
    if found:
        raise _disagrees(ckpt, found)
