"""The run directory is finetune's, and only finetune's.

This module owns its layout (every file and folder name finetune writes), every deletion in it, the lock that
keeps one live process per run, the content inventories (size and sha256 of every file) of checkpoints and
exports, and the rules for where a run directory may be. Nothing else in the package names a run-dir entry or
removes one.

What may be deleted: only entries of the layout below, and inside every folder of it (``checkpoints/step-N``,
``final/``, the trackers' ``wandb/`` and ``tensorboard/``, and the scratch ``final.tmp``, ``final.old.tmp``,
``reshard.tmp``, ``checkpoints/step-N.tmp``) only what the folder's own ``manifest.json`` lists; in a write that
never finished (a crashed ``step-N.tmp`` or ``reshard.tmp``: no manifest yet) only what such a write writes
(:func:`_owned`). Everything else is the user's: ``--overwrite`` and resume refuse, listing it, and no deletion
(pruning, a crash's scratch) ever removes it.
No torch here: the CLI uses this module before anything heavy is imported.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune import __version__
from finetune.config import outputs, to_yaml
from finetune.errors import RunDirError

if TYPE_CHECKING:
    from finetune.config import RecipeConfig

# --- the layout -----------------------------------------------------------------------------------------------
MARKER = "finetune-run.json"  # the run id: what makes a folder a finetune run
LOCK = "finetune.lock"  # flock'ed by the one live process of the run; holds its pid
RESOLVED = "recipe.resolved.yaml"
RESUMING = "recipe.resuming.yaml"  # a resume's recipe until its checkpoint has loaded, then it becomes RESOLVED
METRICS = "metrics.jsonl"
TRAIN_LOG = "train.log"
WANDB_RUN_ID = "wandb_run_id.txt"
PLOTS = "plots.png"  # loss, lr, grad norm and eval metrics against step, redrawn at the end of every run
WANDB = "wandb"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
FINAL = "final"
TMP = ".tmp"
FINAL_TMP = FINAL + TMP  # an export being written
FINAL_OLD = FINAL + ".old" + TMP  # the previous export, while the new one replaces it
MANIFEST = "manifest.json"  # in every checkpoint and export: run id, and size + sha256 of every other file
TRAIN_STATE = "train_state.json"
MERGE_CHECK = "merge_check.safetensors"
RESHARD_TMP = "reshard" + TMP  # a checkpoint converted for another layout while a resume reads it (then removed)

_FILES = frozenset({MARKER, MARKER + TMP, LOCK, RESOLVED, RESOLVED + TMP, RESUMING, RESUMING + TMP, METRICS,
                    TRAIN_LOG, WANDB_RUN_ID, PLOTS, PLOTS + TMP})
_TREES = frozenset({WANDB, TENSORBOARD, FINAL_TMP, FINAL_OLD,  # written whole by finetune (or a sink for it)
                    RESHARD_TMP})
LAYOUT_FILES = _FILES  # every file name finetune writes at the top of a run dir (tests enumerate these)
LAYOUT_TREES = _TREES | {CHECKPOINTS, FINAL}  # every folder it writes there
_STEP = re.compile(r"step-(\d{6,})")
# what a conversion writes in reshard.tmp (finetune.artifacts.portable)
RESHARD_WRITES = ("converted.json", "universal")
# safetensors (0.7+) writes a file through a hidden ``.tmp`` + 6 letters or digits in the destination folder (Rust's
# tempfile crate) and renames it: a write killed mid-save leaves one in any folder of a checkpoint being written
SAVE_SCRATCH = re.compile(r"\.tmp[A-Za-z0-9]{6}")
_HASH_BLOCK = 1 << 20


def step_dir(run_dir: Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step-000400``."""
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def _is_step_folder(path: Path, *, tmp: bool) -> bool:
    """A real folder (not a link) named ``step-N`` (``tmp``: ``step-N.tmp``, a write in progress or crashed)."""
    name = path.name.removesuffix(TMP) if tmp else path.name
    return path.name.endswith(TMP) == tmp and bool(_STEP.fullmatch(name)) and path.is_dir() and not path.is_symlink()


def _step_folders(run_dir: Path, *, tmp: bool) -> list[Path]:
    root = run_dir / CHECKPOINTS
    if not root.is_dir() or root.is_symlink():
        return []
    return sorted((p for p in root.iterdir() if _is_step_folder(p, tmp=tmp)),
                  key=lambda p: int(_STEP.fullmatch(p.name.removesuffix(TMP)).group(1)))  # type: ignore[union-attr]


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders (``step-N``, renamed from ``step-N.tmp``), oldest first; anything else in
    ``checkpoints/`` (a stray file, a symlink, a crashed ``.tmp``) is not a checkpoint."""
    return _step_folders(run_dir, tmp=False)


def stale_checkpoint_dirs(run_dir: Path) -> list[Path]:
    """``step-N.tmp`` folders: writes that never completed (a crash), never resumed from."""
    return _step_folders(run_dir, tmp=True)


# --- writing: never through a link, never into what finetune did not make ----------------------------------------


def _not_plain(st: os.stat_result) -> str | None:
    """What makes ``st`` something finetune may not write (None for a regular file with one link)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if not stat.S_ISREG(st.st_mode):
        return "a FIFO, socket or device"
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} hard links (another name shares its bytes)"
    return None


def _refusal(path: Path, what: str) -> RunDirError:
    return RunDirError(f"{path}: finetune writes this file, but it is {what}; finetune never writes through it: "
                       "move it away (nothing was written)")


def check_write_target(path: Path) -> None:
    """Refuse (one RunDirError line) unless ``path`` is absent or a regular file with one link: finetune writes
    only files it creates, or its own earlier files, never through a symlink or hard link, into a FIFO or over a
    folder."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    what = _not_plain(st)
    if what:
        raise _refusal(path, what)


def check_write_tree(path: Path) -> None:
    """Refuse unless ``path`` is absent or a real folder (not a symlink to one, not a file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise RunDirError(f"{path}: finetune writes into this folder, but it is {what}; finetune never writes "
                          "through it: move it away (nothing was written)")


def check_layout(run_dir: Path) -> None:
    """Before a command writes an existing run: every name of the layout is absent or what finetune writes there
    (a plain file for a file name, a real folder for a folder name), and so is every step folder name in
    ``checkpoints/``; else one RunDirError line, before any work."""
    for name in sorted(LAYOUT_FILES):
        check_write_target(run_dir / name)
    for name in sorted(LAYOUT_TREES):
        check_write_tree(run_dir / name)
    root = run_dir / CHECKPOINTS
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if _STEP.fullmatch(entry.name.removesuffix(TMP)):
                check_write_tree(entry)


def open_checked(path: Path, flags: int) -> int:
    """``os.open`` a file finetune writes (created when missing), refusing what :func:`check_write_target`
    refuses, checked on the opened file itself (a swap between the check and the open is caught too). Never
    blocks on a FIFO. Returns the descriptor."""
    check_write_target(path)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise _refusal(path, "not a regular file") from None
        raise
    what = _not_plain(os.fstat(fd))
    if what:
        os.close(fd)
        raise _refusal(path, what)
    os.set_blocking(fd, True)
    return fd


def open_append(path: Path) -> Any:
    """Open a log finetune appends to (train.log, metrics.jsonl) as text, refusing links, FIFOs and folders."""
    return os.fdopen(open_checked(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")


def write_bytes_atomic(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """Write ``path`` through a temporary file + rename, so a reader never sees half a file. ``tmp`` (default
    ``path.tmp``) is created fresh (an earlier one of finetune's is removed first; anything else there is refused,
    as is anything but a plain file at ``path``); nothing is left behind on failure."""
    tmp = path.with_name(path.name + TMP) if tmp is None else tmp
    check_write_target(path)
    check_write_target(tmp)
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)  # live while written: clear_stale_scratch leaves it alone
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# --- inventories: what a checkpoint or export holds -------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _walk(folder: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every entry under ``folder`` by relative path, never following symlinks."""
    stack = [(folder, "")]
    while stack:
        here, prefix = stack.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                rel = prefix + entry.name
                yield rel, entry
                if entry.is_dir(follow_symlinks=False):
                    stack.append((Path(entry.path), rel + "/"))


def inventory(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every regular file under ``folder`` except its manifest (what the manifest records)."""
    return {rel: {"size": entry.stat(follow_symlinks=False).st_size, "sha256": sha256_file(Path(entry.path))}
            for rel, entry in sorted(_walk(folder)) if entry.is_file(follow_symlinks=False) and rel != MANIFEST}


class ManifestError(RunDirError):
    """A folder's manifest is missing or is not a manifest; ``reason`` says which, without the path."""

    def __init__(self, folder: Path, reason: str) -> None:
        super().__init__(f"{folder}: {reason}")
        self.reason = reason


def read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest; a ManifestError saying what is wrong when it is missing or not a manifest."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(folder, f"no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ManifestError(folder, f"{MANIFEST} is corrupted ({detail})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise ManifestError(folder, f"{MANIFEST} is corrupted (no file inventory)")
    return data


def entries(folder: Path) -> dict[str, os.DirEntry[str]]:
    """Every file and link under ``folder`` by relative path (folders left out), from one walk."""
    return {rel: entry for rel, entry in _walk(folder) if not entry.is_dir(follow_symlinks=False)}


def inventory_problems(folder: Path, manifest: dict[str, Any], *, hashes: bool,
                       present: dict[str, os.DirEntry[str]] | None = None) -> list[str]:
    """What differs between ``folder`` and its manifest's inventory: missing, resized or (with ``hashes``) changed
    files, and files or links it does not list. Empty when the folder is exactly what was written. ``present``:
    the folder's :func:`entries`, when the caller has them already."""
    listed: dict[str, dict[str, Any]] = manifest["files"]
    present = entries(folder) if present is None else present
    problems = []
    for rel, expected in listed.items():
        entry = present.get(rel)
        if entry is None or not entry.is_file(follow_symlinks=False):
            problems.append(f"{rel} is missing")
        elif entry.stat(follow_symlinks=False).st_size != expected.get("size"):
            problems.append(f"{rel} has the wrong size")
        elif hashes and sha256_file(Path(entry.path)) != expected.get("sha256"):
            problems.append(f"{rel} was modified (sha256 differs)")
    problems += [f"{rel} is not part of it" for rel in sorted(present) if rel not in listed and rel != MANIFEST]
    return problems


def write_manifest(folder: Path, data: dict[str, Any]) -> None:
    """Write ``data`` plus the inventory of ``folder`` as its manifest (the last file written into it)."""
    (folder / MANIFEST).write_text(json.dumps({**data, "files": inventory(folder)}, indent=2), encoding="utf-8")


# --- what is finetune's ----------------------------------------------------------------------------------------


def tree_names(folder: Path) -> set[str]:
    """The relative names of every file and link under ``folder`` now (what a tracker found there at its start)."""
    if not folder.is_dir() or folder.is_symlink():
        return set()
    return {rel for rel, entry in _walk(folder) if not entry.is_dir(follow_symlinks=False) and rel != MANIFEST}


def record_tree(folder: Path, before: set[str]) -> None:
    """Write the inventory of a folder a library writes for finetune (``wandb/``, ``tensorboard/``): what its
    manifest listed already, plus every file and link that appeared since ``before`` (:func:`tree_names` at the
    tracker's start), so ``--overwrite`` deletes those and nothing a user put there."""
    if not folder.is_dir() or folder.is_symlink():
        return
    try:
        listed = dict(read_manifest(folder)["files"])
    except ManifestError:
        listed = {}
    for rel, entry in sorted(_walk(folder)):
        if rel in before or rel in listed or rel == MANIFEST or entry.is_dir(follow_symlinks=False):
            continue
        listed[rel] = ({"link": os.readlink(entry.path)} if entry.is_symlink()
                       else {"size": entry.stat(follow_symlinks=False).st_size})
    write_text_atomic(folder / MANIFEST, json.dumps({"kind": "tracker", "files": listed}, indent=2))


def _with_folders(names: Iterable[str]) -> set[str]:
    """``names`` (relative file names) and every folder they lie in."""
    found = set(names)
    for name in list(found):
        parts = name.split("/")
        found.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return found


def _shape(name: str) -> re.Pattern[str]:
    """``name`` with every run of digits free: the shape of the names a writer repeats per rank, shard or step."""
    return re.compile(re.sub(r"\d+", lambda _: r"\d+", re.escape(name)))


def _owned(folder: Path) -> Callable[[str], bool] | None:
    """Which entries of ``folder`` (relative names, folders included) finetune wrote: its manifest's inventory. A
    write that never finished has no manifest yet; its inventory is what such a write writes: in a crashed
    ``checkpoints/step-N.tmp``, the names the run's complete checkpoints list (digits free: ranks and shards) and
    safetensors' half-written scratch files in them (:data:`SAVE_SCRATCH`), in a
    run's crashed ``reshard.tmp``, a conversion's files (:data:`RESHARD_WRITES`). None: no inventory (a killed
    tracker's folder, a bare final.tmp): the user decides about all of it."""
    try:
        listed = _with_folders(read_manifest(folder)["files"]) | {MANIFEST}
        return listed.__contains__
    except ManifestError:
        pass
    if folder.name == RESHARD_TMP and (folder.parent / MARKER).is_file():
        return lambda rel: rel.split("/")[0] in RESHARD_WRITES
    if not (_is_step_folder(folder, tmp=True) and folder.parent.name == CHECKPOINTS):
        return None
    names: set[str] = {MANIFEST}
    for done in checkpoint_dirs(folder.parent.parent):
        with contextlib.suppress(ManifestError):
            names |= set(read_manifest(done)["files"])
    shapes = [_shape(name) for name in _with_folders(names)]

    def listed(rel: str) -> bool:
        return any(shape.fullmatch(rel) for shape in shapes)

    def written(rel: str) -> bool:
        parent, _, name = rel.rpartition("/")
        return listed(rel) or (SAVE_SCRATCH.fullmatch(name) is not None and (not parent or listed(parent)))

    return written


def _foreign_in_listed(folder: Path, label: str) -> list[str]:
    """Entries of a folder finetune writes that are not in its inventory (:func:`_owned`; all of it, without one:
    a killed tracker's folder cannot be told from the user's, so the user decides)."""
    owned = _owned(folder)
    if owned is None:
        return [f"{label}/ (no readable {MANIFEST}: not written by finetune, or a write it never finished; look "
                "inside and remove it yourself)"]
    return [f"{label}/{rel}" for rel, _ in sorted(_walk(folder)) if not owned(rel)]


def remove_owned(folder: Path, label: str) -> list[str]:
    """Delete what finetune wrote in ``folder`` (its inventory, :func:`_owned`), then the folders that leaves empty,
    ``folder`` too; returns what stays, the user's (as ``--overwrite`` lists it), which is never touched."""
    owned = _owned(folder)
    leftover = _foreign_in_listed(folder, label)
    if owned is None:
        return leftover
    for rel, entry in sorted(_walk(folder), key=lambda item: item[0].count("/"), reverse=True):  # deepest first
        if not owned(rel):
            continue
        with contextlib.suppress(OSError):  # a folder not empty holds the user's; a file gone is gone
            if entry.is_dir(follow_symlinks=False):
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
    with contextlib.suppress(OSError):
        folder.rmdir()
    return leftover


def crashed_writes_foreign(run_dir: Path) -> list[str]:
    """What the user put in the scratch of writes that never finished (crashed ``checkpoints/step-N.tmp``, a
    killed resume's ``reshard.tmp``): the next resume removes that scratch, all but these."""
    found: list[str] = []
    for folder in (*stale_checkpoint_dirs(run_dir), run_dir / RESHARD_TMP):
        if folder.is_dir() and not folder.is_symlink():
            found += _foreign_in_listed(folder, str(folder.relative_to(run_dir)))
    return found


def foreign_entries(run_dir: Path) -> list[str]:
    """Everything in ``run_dir`` that finetune did not write (relative paths); empty for a pure run dir."""
    foreign: list[str] = []
    with os.scandir(run_dir) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            name, path = entry.name, Path(entry.path)
            is_dir = entry.is_dir(follow_symlinks=False)
            if entry.is_symlink():
                foreign.append(name)
            elif name in _FILES and entry.is_file(follow_symlinks=False):
                continue
            elif (name == FINAL or name in _TREES) and is_dir:
                foreign += _foreign_in_listed(path, name)
            elif name == CHECKPOINTS and is_dir:
                foreign += _foreign_in_checkpoints(path)
            else:
                foreign.append(name)
    return foreign


def _foreign_in_checkpoints(root: Path) -> list[str]:
    foreign: list[str] = []
    for entry in sorted(root.iterdir()):
        label = f"{CHECKPOINTS}/{entry.name}"
        if _is_step_folder(entry, tmp=False) or _is_step_folder(entry, tmp=True):
            foreign += _foreign_in_listed(entry, label)
        else:
            foreign.append(label)
    return foreign


def _listing(names: list[str], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_replaceable_export(folder: Path) -> None:
    """Refuse to replace ``folder`` unless finetune wrote all of it (an export whose manifest lists every file)."""
    foreign = _foreign_in_listed(folder, folder.name)
    if foreign:
        raise RunDirError(f"{folder}: --overwrite refused: it holds files finetune did not write "
                          f"({_listing(foreign)}); nothing was deleted; choose another -o")


def _clear(run_dir: Path, keep_lock: bool = True) -> None:
    """Remove every entry of a pure run dir (except the lock, held by the caller, with ``keep_lock``); refuse,
    deleting nothing, when it holds anything finetune did not write."""
    _refuse_foreign(run_dir)
    for entry in run_dir.iterdir():
        if keep_lock and entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def clear_unstarted(run_dir: Path) -> None:
    """Remove everything a run that trained nothing wrote, its lock file included (finetune.storage.unstarted decides
    when); the same rule as --overwrite: refused, deleting nothing, when anything in it is not finetune's."""
    _clear(run_dir, keep_lock=False)


def _refuse_foreign(run_dir: Path) -> None:
    """What ``--overwrite`` refuses: a run dir that holds anything finetune did not write."""
    foreign = foreign_entries(run_dir)
    if foreign:
        raise RunDirError(f"{run_dir}: --overwrite refused: it holds files finetune did not write "
                          f"({_listing(foreign)}); move them away or choose another -o; nothing was deleted")


def remove_checkpoint(path: Path, *, written_now: bool = False) -> list[str]:
    """Delete one checkpoint folder (complete or a crashed ``.tmp``) of a run: what finetune wrote in it
    (:func:`remove_owned`), the folder once empty; returns what stays (the user's). ``written_now``: a ``.tmp``
    this process is writing and gives up (a failed save): all of it is this write's."""
    if path.parent.name != CHECKPOINTS or not (_is_step_folder(path, tmp=False) or _is_step_folder(path, tmp=True)):
        raise AssertionError(f"not a checkpoint folder: {path}")
    if written_now:
        shutil.rmtree(path, ignore_errors=True)
        return []
    return remove_owned(path, f"{CHECKPOINTS}/{path.name}")


# A scratch folder or file beside an output ``out``: ``.<out>.[check.|old.]<8 random chars>.tmp``. Its writer holds an
# flock on it for as long as it lives, so a later command on the same output can tell a live one (skip it) from
# one a killed export, merge or generate left behind (remove it).
_SCRATCH_SUFFIX = re.compile(r"\.(?:(?:check|old)\.)?[A-Za-z0-9_]{8}" + re.escape(TMP))
_held: dict[str, int] = {}  # scratch path -> the descriptor holding its flock, for this process's scratch


def _scratch_of(out: Path, entry: Path) -> bool:
    prefix = f".{out.name}"
    return entry.name.startswith(prefix) and bool(_SCRATCH_SUFFIX.fullmatch(entry.name[len(prefix):]))


def clear_stale_scratch(out: Path) -> list[Path]:
    """Remove the hidden scratch folders and files beside ``out`` that a killed command left behind (no live
    process holds their flock); returns what was removed. Links and anything not named like finetune's scratch
    are never touched."""
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    for entry in sorted(out.parent.iterdir()):
        if str(entry) in _held or entry.is_symlink() or not _scratch_of(out, entry):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live export, merge or generate is writing it
        finally:
            os.close(fd)
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def scratch_dir(out: Path, kind: str = "") -> Path:
    """A fresh hidden folder beside ``out`` (``kind``: ``check``, ``old`` or the export itself), held under this
    process's flock until :func:`remove_scratch` or :func:`publish`; stale ones of killed commands are removed
    first. Its mode is the umask's usual one (mkdtemp's 0700 would make the export private)."""
    clear_stale_scratch(out)
    path = Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind + '.' if kind else ''}", suffix=TMP, dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    hold_scratch(path)
    return path


def hold_scratch(path: Path) -> None:
    """Take the flock that marks ``path`` (a scratch folder or file this process just created) as live."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held[str(path)] = fd


def release_scratch(path: Path) -> None:
    """Drop the flock of a scratch path of this process (renamed into place, or removed)."""
    fd = _held.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def remove_scratch(path: Path) -> None:
    """Delete a ``.tmp`` folder that this process created (an export or merge being written)."""
    if not path.name.endswith(TMP) or path.is_symlink():
        raise AssertionError(f"not a scratch folder: {path}")
    shutil.rmtree(path, ignore_errors=True)
    release_scratch(path)


def reshard_scratch(run_dir: Path) -> Path:
    """``<run_dir>/reshard.tmp``: where a resume on another layout converts a checkpoint (finetune.artifacts.portable).
    A folder left there by a crash is removed before the next conversion and after every one."""
    return run_dir / RESHARD_TMP


def publish(tmp: Path, out: Path, old: Path) -> None:
    """Put the completed folder ``tmp`` at ``out``. A previous ``out`` is moved to ``old`` first and deleted only
    once the new one is in place, so a crash at any moment leaves a complete export at ``out`` or at ``old``."""
    check_write_tree(out)  # a symlink or a file at ``out`` is refused before anything moves
    if old.exists():
        remove_scratch(old)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    release_scratch(tmp)
    if old.exists():
        remove_scratch(old)
    release_scratch(old)


# --- where a run dir may be ------------------------------------------------------------------------------------


def _is_at_or_above(folder: Path, other: Path) -> bool:
    return folder == other or folder in other.parents


# How a run dir that overlaps an input is refused, by how it stands to it (finetune.config.outputs.overlap)
_OVERLAP = {"is": "it is {}", "contains": "{} is in it", "lies inside": "it lies inside {}"}


def check_location(run_dir: Path, protected: Iterable[outputs.Input | Path | str] = ()) -> None:
    """Refuse run dirs that would mix a run into, or let ``--overwrite`` reach, what is not the run's: ``/``, the
    home folder, the current folder (or a folder above them), a folder that holds finetune itself, a path that is,
    holds or lies inside anything in ``protected`` (what the run reads: ``(what, where)`` as
    :func:`finetune.config.outputs.recipe_inputs` lists it, or a bare path), and a path that is a file."""
    target = run_dir.resolve()
    places: list[tuple[Path, str]] = [(Path.cwd().resolve(), "the current folder")]
    with contextlib.suppress(RuntimeError, KeyError):  # no home folder known: nothing to protect there
        places.append((Path.home().resolve(), "your home folder"))
    places.append((Path(__file__).resolve().parents[1], "the finetune package"))
    why = "it is the root folder" if target.parent == target else next(
        (f"{what} is in it" if where != target else f"it is {what}" for where, what in places
         if _is_at_or_above(target, where)), None)
    found = None if why else outputs.overlap(run_dir, [p if isinstance(p, tuple) else ("", p) for p in protected])
    if found is not None:
        why = _OVERLAP[found.how].format(found.input)
    if why is None and run_dir.is_symlink():
        why = "it is a symbolic link; finetune never writes through one"
    elif why is None and target.exists() and not target.is_dir():
        why = "it is a file"
    enclosing = enclosing_run(target.parent) if why is None else None
    if enclosing is not None:
        why = f"it lies inside the run {enclosing}"
    if why:
        raise RunDirError(f"{run_dir}: cannot be a run directory ({why}); choose another output_dir / -o, "
                          "e.g. runs/<name>")


# --- the lock --------------------------------------------------------------------------------------------------


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/finetune.lock`` for the life of the process that holds it.

    The kernel drops it when the process ends in any way (SIGKILL included), so it never goes stale. The file
    holds the holder's pid and command for the refusal message. ``inherit()`` keeps it across ``exec`` (the
    ``accelerate launch`` that replaces the front process holds it until every rank has exited).
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @staticmethod
    def _take(fd: int, run_dir: Path) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(f"{run_dir} is in use by {holder}; wait for it to finish or stop it, then try again") \
                from None

    @classmethod
    def check_free(cls, run_dir: Path) -> None:
        """Raise like :meth:`acquire` when a live process holds the run, without creating or keeping anything."""
        try:
            fd = os.open(run_dir / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError:  # not a lockable file (a link, a folder): check_layout / acquire say what it is
            return
        cls._take(fd, run_dir)
        os.close(fd)

    @classmethod
    def acquire(cls, run_dir: Path, command: str) -> RunLock:
        """Take the run's lock, or raise a RunDirError naming the live process that holds it."""
        fd = open_checked(run_dir / LOCK, os.O_RDWR)
        cls._take(fd, run_dir)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} (`{command}`, since {time.strftime('%Y-%m-%d %H:%M:%S')})\n".encode(), 0)
        return cls(fd, run_dir / LOCK)

    def inherit(self) -> None:
        """Keep the lock in a program this process ``exec``s."""
        os.set_inheritable(self.fd, True)

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --- creating and opening runs ---------------------------------------------------------------------------------


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` through ``path.tmp`` + rename, so a reader never sees half a file."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_resolved(cfg: RecipeConfig, run_dir: Path, name: str = RESOLVED) -> Path:
    """Write ``<run_dir>/recipe.resolved.yaml`` atomically: from here on the single source of truth of the run.
    A resume writes ``recipe.resuming.yaml`` instead, which :func:`adopt_resumed` makes the run's recipe once the
    checkpoint has loaded (a resume that fails leaves the run's recipe as it was)."""

    path = run_dir / name
    write_text_atomic(path, to_yaml(cfg))
    return path


def adopt_resumed(cfg: RecipeConfig | None, run_dir: Path) -> None:
    """The resume's recipe becomes the run's recipe (its checkpoint loaded), or is dropped (``cfg`` None: the
    checkpoint did not load, and the run keeps the recipe it had)."""
    if cfg is not None:
        write_resolved(cfg, run_dir)
    (run_dir / RESUMING).unlink(missing_ok=True)


def run_id(run_dir: Path) -> str:
    """The run's id from its marker; a RunDirError when ``run_dir`` is not a finetune run."""
    check_write_target(run_dir / MARKER)  # a link or FIFO is no marker of finetune's (and a FIFO would hang)
    try:
        data = json.loads((run_dir / MARKER).read_text(encoding="utf-8"))
        return str(data["run_id"])
    except FileNotFoundError:
        raise RunDirError(f"{run_dir}: not a finetune run directory (no {MARKER}; runs made by finetune before "
                          "0.2 have none); start a run with `finetune run`") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        raise RunDirError(f"{run_dir / MARKER} is corrupted; this run cannot be verified") from None


def _visible(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK)


def check_creatable(run_dir: Path, *, overwrite: bool, protected: Iterable[outputs.Input | Path | str] = ()
                    ) -> None:
    """Raise what :func:`create` would refuse, writing nothing: `finetune run` asks before its data check (so a
    refused run costs no tokenizing), and ``--dry-run`` reports it."""
    check_location(run_dir, protected)
    if run_dir.is_dir() and _visible(run_dir):
        if not (run_dir / MARKER).is_file():
            raise RunDirError(f"{run_dir} exists and is not a finetune run (it holds {_listing(_visible(run_dir))}); "
                              "finetune never writes into or deletes such a folder: choose another output_dir / -o")
        RunLock.check_free(run_dir)
        if overwrite:
            _refuse_foreign(run_dir)
        else:
            resume = f", or `finetune resume {run_dir}` to continue it" if checkpoint_dirs(run_dir) else ""
            raise RunDirError(f"{run_dir} already holds a run; pass --overwrite to replace it (only what finetune "
                              f"wrote is deleted), or -o DIR for a new one{resume}")


def create(run_dir: Path, *, overwrite: bool, protected: Iterable[outputs.Input | Path | str] = (),
           command: str = "finetune run") -> RunLock:
    """Make ``run_dir`` a new, empty run and lock it (the caller releases the lock when the run ends).

    Allowed: a folder that does not exist or is empty; with ``overwrite``, a finetune run that holds nothing but
    what finetune wrote (those entries are deleted). Refused: a run without ``overwrite``, a run that holds
    anything else, any other non-empty folder, a run another process is using, and the places
    :func:`check_location` protects (:func:`check_creatable`).
    """
    check_creatable(run_dir, overwrite=overwrite, protected=protected)
    if run_dir.is_dir() and _visible(run_dir):
        lock = RunLock.acquire(run_dir, command)
        try:
            _clear(run_dir)
        except BaseException:
            lock.release()
            raise
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock.acquire(run_dir, command)

    write_text_atomic(run_dir / MARKER, json.dumps({"run_id": uuid.uuid4().hex, "finetune": __version__,
                                                    "created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    return lock


def open_existing(run_dir: Path, command: str) -> tuple[RunLock, str]:
    """Lock an existing run for a command that writes it (resume); returns the lock and the run id."""
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: not a run directory (no such folder); start one with `finetune run`")
    rid = run_id(run_dir)
    check_layout(run_dir)
    RunLock.check_free(run_dir)  # a live run's own scratch is no crash's: it refuses first
    foreign = crashed_writes_foreign(run_dir)
    if foreign:
        raise RunDirError(f"{run_dir}: resume refused: the scratch of a write that never finished holds files "
                          f"finetune did not write ({_listing(foreign)}); move them away, then resume (finetune "
                          "then removes the rest of that scratch; nothing was deleted)")
    return RunLock.acquire(run_dir, command), rid


def enclosing_run(path: Path) -> Path | None:
    """The run directory that ``path`` is (or lies in), if any: the nearest folder at or above it with a marker."""
    path = path.resolve()
    return next((p for p in (path, *path.parents) if (p / MARKER).is_file()), None)
