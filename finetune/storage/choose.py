"""Which checkpoint a command uses: the one place that chooses (resume, export, eval of a run's checkpoint, ls).

The choice is the newest complete resumable checkpoint, or the one ``--from`` names (a name in ``checkpoints/`` or a
path). Each checkpoint's manifest is read once, here (:func:`finetune.storage.checkpoints.inspect`), and carried on the
returned :class:`Chosen` (``info.manifest``) for the caller to verify and use. Newer checkpoints passed over are
returned as ``(name, reason)`` pairs, which the callers print one line each (:func:`skipped_lines`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from finetune.errors import RunDirError
from finetune.storage import checkpoints, rundir
from finetune.storage.checkpoints import CheckpointInfo

NO_CHECKPOINT = {  # what the command does, for the line that says none can be chosen
    "resume": "no complete resumable checkpoint to resume from",
    "export": "no complete checkpoint to export",
}


@dataclass(frozen=True)
class Chosen:
    """The chosen checkpoint (its manifest, read once, is ``info.manifest``) and the newer ones passed over."""

    info: CheckpointInfo
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why it was passed over), newest last

    @property
    def path(self) -> Path:
        return self.info.path


def inventory(run_dir: Path) -> list[CheckpointInfo]:
    """Every complete-named checkpoint of ``run_dir``, oldest first, each manifest read once (``finetune ls``)."""
    return [checkpoints.inspect(path) for path in rundir.checkpoint_dirs(run_dir)]


def choose(run_dir: Path, name: str | None, purpose: str = "resume") -> Chosen:
    """The checkpoint ``name`` (e.g. ``step-000100``, or a path) or, for None, the newest resumable one, with the
    newer ones passed over and why; RunDirError (one line) if none fits. ``purpose`` (``resume`` or ``export``)
    words that line. Whether it belongs to this run is checked by :func:`finetune.storage.checkpoints.verify`."""
    if name is None:
        infos = inventory(run_dir)
        newest = checkpoints.latest_resumable(run_dir, infos)
        if newest is None:
            broken = [f"{info.path.name}: {info.reason}" for info in infos]
            detail = f" ({'; '.join(broken)})" if broken else ""
            raise RunDirError(f"{run_dir}: {NO_CHECKPOINT[purpose]}{detail}; " + _what_now(run_dir, purpose))
        newer = infos[infos.index(newest) + 1:]
        return Chosen(newest, [(info.path.name, str(info.reason)) for info in newer])
    path = Path(name) if Path(name).is_dir() and not Path(name).is_symlink() else run_dir / rundir.CHECKPOINTS / name
    if not path.is_dir() or path.name.endswith(rundir.TMP):
        names = ", ".join(p.name for p in rundir.checkpoint_dirs(run_dir)) or "none"
        raise RunDirError(f"--from {name}: no such complete checkpoint in {run_dir / rundir.CHECKPOINTS} "
                          f"(have: {names})")
    info = checkpoints.inspect(path)
    if not info.resumable:
        raise RunDirError(f"{path}: not resumable: {info.reason}")
    return Chosen(info)


def skipped_lines(chosen: Chosen) -> list[str]:
    """One line per checkpoint passed over: ``skipped step-000300: <why>; using step-000200``."""
    return [f"skipped {name}: {reason}; using {chosen.path.name}" for name, reason in chosen.skipped]


def _what_now(run_dir: Path, purpose: str) -> str:
    if purpose == "export":
        return f"`finetune ls {run_dir}` lists them"
    return f"start the run again with `finetune run {run_dir / rundir.RESOLVED} --overwrite`"
