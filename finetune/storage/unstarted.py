"""A ``finetune run`` that fails before its first optimizer step leaves no run folder behind.

`finetune run` creates the run folder only once the recipe is valid and its data has been read (the data check).
What can still fail before training starts (a model folder, a LoRA target, a plugin, Ctrl+C while the model loads)
would otherwise leave a folder that the next ``finetune run`` refuses without ``--overwrite`` and whose suggested
``finetune resume`` has no checkpoint. :func:`discard` removes exactly what that invocation wrote, and only when
nothing was trained: no checkpoint, no export, no train row in metrics.jsonl. Like ``--overwrite`` it deletes
nothing finetune did not write: a folder that holds anything else (or a tracker folder without its manifest) is
left as it is. The folder itself, and the parents that ``mkdir`` made for it, are removed only when this invocation
created them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from finetune.errors import RunDirError
from finetune.storage import rundir
from finetune.storage.metrics import read_metrics

# Entries whose presence means the run did work worth keeping (a checkpoint, an export, or one being written).
_WORK = (rundir.CHECKPOINTS, rundir.FINAL, rundir.FINAL_TMP, rundir.FINAL_OLD, rundir.RESHARD_TMP)


def first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` (itself included) that does not exist yet: what ``mkdir -p`` will make."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing = folder
    return missing


def trained_nothing(run_dir: Path) -> bool:
    """Whether the run wrote no checkpoint, no export and no train row (a damaged metrics.jsonl counts as work)."""
    if any((run_dir / name).exists() or (run_dir / name).is_symlink() for name in _WORK):
        return False
    if not (run_dir / rundir.METRICS).exists():
        return True
    try:
        rows = read_metrics(run_dir)
    except (RunDirError, OSError, UnicodeDecodeError):
        return False
    return not any(isinstance(row, dict) and row.get("kind") == "train" for row in rows)


def discard(run_dir: Path, made: Path | None) -> bool:
    """Remove what a ``finetune run`` wrote into ``run_dir`` when it trained nothing (called while the run's lock is
    still held; the lock file goes too). ``made``: the outermost folder this invocation created for it
    (:func:`first_missing` before the run dir was created), None when the folder existed: then it stays, empty, as
    the user had it. Returns whether anything was removed; never raises, since the run's own error is the one to
    report."""
    try:
        if not run_dir.is_dir() or not (run_dir / rundir.MARKER).is_file() or not trained_nothing(run_dir):
            return False
        if rundir.foreign_entries(run_dir):
            return False
        rundir.clear_unstarted(run_dir)
        if made is not None and (made == run_dir or made in run_dir.parents):
            for folder in (run_dir, *run_dir.parents):
                with contextlib.suppress(OSError):  # a folder someone else has filled meanwhile stays
                    folder.rmdir()
                if folder == made:
                    break
        return True
    except OSError:
        return False
