"""Planning a resume in the front process (no torch): which checkpoint, and what changed since it was written.

The checkpoint must belong to this run (its manifest's run id) and pass verification (the sha256 of every file)
before anything is loaded or any log is touched. A resume continues the same run, so any difference between the
checkpoint's recipe and the present one, between the data files then and now, or between the files that define the
objective then and now (a reward model's weights, a reward function's source file, the reference model:
:mod:`finetune.storage.objective`) is refused (listing every difference) unless the user passes
``--allow-config-change``; then the differences are written to train.log. A checkpoint written before the objective
was fingerprinted resumes without that check, with a note that says so. Keys that change how the work is laid out
but not the math (process count, accelerate config, micro-batch size, progress bar, and the kernels: attention
implementation, torch.compile, fused AdamW) are always allowed: the data cursor and the token-weighted loss do not
depend on them. ``trust_remote_code`` comes only from this command line
(``--trust-remote-code``), never from the run's files; it also decides whether the recipe's ``model.plugin`` may be
imported, here and in the launched workers (``--allow-plugin``). The tokenizer is compared in the worker, which loads it
anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config import REMOTE_CODE_KEY, RecipeConfig, outputs, remote_code_from_flag, validate
from finetune.config.compose import compose_stored, flatten
from finetune.errors import FinetuneError, RunDirError
from finetune.storage import checkpoints, objective, restored, rundir
from finetune.storage.choose import choose, skipped_lines
from finetune.storage.state import total_steps

LAYOUT_KEYS = ("launch.num_processes", "launch.accelerate_config", "launch.timeout_minutes", "train.micro_batch_size",
               "logging.progress", "output_dir", REMOTE_CODE_KEY,
               # kernels: the same function computed another way (a resume on a GPU machine may switch them on)
               "model.attn_implementation", "train.compile", "optim.fused")


@dataclass
class ResumePlan:
    """The recipe to continue with, the checkpoint to continue from, and what differs from it."""

    cfg: RecipeConfig
    checkpoint: checkpoints.CheckpointInfo
    changes: list[str] = field(default_factory=list)
    layout_changes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # one line per newer checkpoint passed over, and why
    notes: list[str] = field(default_factory=list)  # what was not checked, and why (said and logged, never refused)
    finished: str | None = None  # the line for a finished run: nothing to resume (see finished_line)


def recipe_changes(before: dict[str, Any], after: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(changes that alter the run, layout-only changes), one ``key: old -> new`` line each."""
    old, new = flatten(before), flatten(after)
    changes, layout = [], []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) != new.get(key):
            line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
            (layout if key in LAYOUT_KEYS else changes).append(line)
    return changes, layout


def data_changes(cfg: RecipeConfig, manifest: dict[str, Any]) -> list[str]:
    """Data files whose content differs from the fingerprints in the manifest; one line per changed source when
    data.train / data.eval is a list of sources (a list of another length is one line: the recipe diff lists it)."""
    stored = manifest.get("data", {})
    lines = []
    for split, value in (("train", cfg.data.train), ("eval", cfg.data.eval)):
        now, before = checkpoints.data_fingerprint(value), stored.get(split)
        if now == before:
            continue
        if isinstance(value, list) and isinstance(before, list) and len(before) == len(value):
            assert isinstance(now, list)
            lines += [f"data.{split}[{i}]: {source.path} changed since the checkpoint (sha256 {str(old)[:12]} -> "
                      f"{str(new)[:12]})" for i, (source, old, new) in enumerate(zip(value, before, now, strict=True))
                      if old != new]
        else:
            shown = value if not isinstance(value, list) else ", ".join(source.path for source in value)
            lines.append(f"data.{split}: {shown} changed since the checkpoint (sha256 {_short(before)} -> "
                         f"{_short(now)})")
    return lines


def _short(fingerprint: str | list[str | None] | None) -> str:
    """A fingerprint as a resume line shows it: 12 characters of a sha256, or of each source's."""
    if isinstance(fingerprint, list):
        return "[" + ", ".join(str(f)[:12] for f in fingerprint) + "]"
    return str(fingerprint)[:12]


def plan(run_dir: Path, run_id: str, overrides: list[str], from_name: str | None, allow_change: bool,
         trust_remote_code: bool = False) -> ResumePlan:
    """Pick (:func:`finetune.storage.choose.choose`) and verify the checkpoint, and compose the recipe to continue
    with; refuse changes unless allowed."""
    overrides = remote_code_from_flag(overrides, trust_remote_code)
    chosen = choose(run_dir, from_name, "resume")
    info = chosen.info
    checkpoints.verify(info.path, run_id, info.manifest)  # the manifest chosen by, read once
    stored = info.path / rundir.RESOLVED
    here = f"output_dir={run_dir.resolve()}"
    cfg = validate(compose_stored(stored, [*overrides, here]), allow_plugin=trust_remote_code)
    # the run dir is what a resume writes: it may not be, hold or lie inside what the recipe (overrides too) reads
    outputs.check_not_input(run_dir, outputs.recipe_inputs(cfg), "finetune resume",
                            "point that input elsewhere (a run directory cannot move)")
    composed = compose_stored(stored, [here])
    try:  # the stored recipe under today's schema: keys added since then hold their defaults, not "changes"
        before = validate(composed, allow_plugin=trust_remote_code).model_dump(mode="json")
    except FinetuneError:
        before = composed.data
    changes, layout = recipe_changes(before, cfg.model_dump(mode="json"))
    changes += data_changes(cfg, info.manifest or {})
    objective_lines, notes = objective_changes(cfg, info.manifest or {}, info.path.name)
    changes += objective_lines
    if changes and not allow_change:
        raise RunDirError("\n".join([f"resume refused: the run changed since {info.path.name}:", *changes,
                                     "pass --allow-config-change to continue anyway (the changes are logged)"]))
    return ResumePlan(cfg, info, changes, layout, skipped_lines(chosen), notes=notes)


def objective_changes(cfg: RecipeConfig, manifest: dict[str, Any], name: str) -> tuple[list[str], list[str]]:
    """(one line per file that defines the objective and changed since checkpoint ``name``, notes): a manifest
    without ``objective`` (an older finetune's checkpoint) has nothing to compare with, which the note says when the
    recipe has such files."""
    stored = manifest.get("objective")
    if isinstance(stored, dict):
        return objective.changes(cfg, stored, name), []
    keys = sorted(key for part in objective.PARTS for key, _ in part.keys(cfg))
    if not keys:
        return [], []
    return [], [f"{name} was written before checkpoints fingerprinted the objective: {', '.join(keys)} not checked "
                "for changes since then"]


def finished_line(run_dir: Path, resume: ResumePlan) -> str | None:
    """The line ``finetune resume RUN`` prints for a finished run, else None. A run is finished when its newest
    resumable checkpoint is at its last step (``train.max_steps``, or the steps that ``train.epochs`` makes of the
    train set), nothing about the recipe or its data changed (the plan's own diff), and ``final/`` was exported from
    that step (or the recipe exports none). Resuming it would train nothing and only write ``final/`` again."""
    info, cfg = resume.checkpoint, resume.cfg
    if info.step is None or resume.changes:
        return None
    state = restored.checked_train_state(info.path)  # a damaged file is a refusal, not a traceback
    total = total_steps(cfg, int(state.get("train_size") or 0))
    if info.step < total:
        return None
    if cfg.checkpoint.save_final and rundir.read_manifest(run_dir / rundir.FINAL).get("step") != info.step:
        return None  # the export is what is left to do
    exported = f"{rundir.FINAL}/ exported at that step" if cfg.checkpoint.save_final else "no export asked for"
    return (f"{run_dir}: finished, nothing to resume ({info.path.name} is step {info.step} of {total}; {exported}). "
            f"Train longer: `finetune resume {run_dir} train.max_steps=N --allow-config-change`; evaluate: "
            f"`finetune eval {run_dir}`")


def begin(run_dir: Path, overrides: list[str], from_name: str | None, allow_change: bool, trust_remote_code: bool,
          *, is_main: bool, warn: Callable[[str], None]) -> tuple[ResumePlan, rundir.RunLock | None]:
    """Everything the front process does to resume a run, in order: lock the run (the main process only; other
    ranks under a launcher just read its id), plan (checkpoint, verification, recipe and data changes), say which
    newer checkpoints are skipped (``warn``), append what happens to train.log and write recipe.resuming.yaml.
    A finished run (:func:`finished_line`, asked only without ``--from``) stops after the plan: the lock is released,
    nothing is written, and the plan carries the line to print.

    Returns the plan and the held lock (None on other ranks), which the caller hands to the launch. On any failure
    the lock is released and nothing in the run dir has changed. The per-rank part (tokenizer and layout checks,
    loading, dropping the metrics rows after the checkpoint) is :func:`finetune.runtime.worker.resume_state`."""
    lock, run_id = rundir.open_existing(run_dir, f"finetune resume {run_dir}") if is_main else (None, "")
    try:
        run_id = run_id or rundir.run_id(run_dir)
        resume = plan(run_dir, run_id, overrides, from_name, allow_change, trust_remote_code)
        resume.finished = finished_line(run_dir, resume) if from_name is None else None
        if resume.finished:
            if lock is not None:
                lock.release()
            return resume, None
        for note in [*resume.skipped, *resume.notes]:
            warn(note)
        if is_main:
            notes = [*resume.skipped, *resume.notes,
                     f"resume from {resume.checkpoint.path.name} (step {resume.checkpoint.step})",
                     *(f"resume: changed {c} (allowed)" for c in resume.changes),
                     *(f"resume: layout {c}" for c in resume.layout_changes)]
            with rundir.open_append(run_dir / rundir.TRAIN_LOG) as log:
                log.writelines(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {note}\n" for note in notes)
            rundir.write_resolved(resume.cfg, run_dir, rundir.RESUMING)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return resume, lock
