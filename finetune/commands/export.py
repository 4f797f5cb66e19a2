"""``finetune export RUN [--from step-N] -o DIR``: any checkpoint of a run as a Hugging Face folder, verified.

Whatever backend and world size wrote the checkpoint (single/DDP safetensors, FSDP1/2 DCP shards, DeepSpeed ZeRO
partitions; full or LoRA), the export runs in this ONE process on the CPU, without a process group:

1. the checkpoint (the newest resumable one, or ``--from``) is verified completely (run id, sha256 of every file)
   before anything in it is read, and ``-o`` is checked (never the run dir or anything in it, never a folder
   finetune did not write);
2. the model its own recipe builds (as the row and with the labels its manifest recorded; plus the adapter for
   LoRA runs) gets the checkpoint's weights through :mod:`finetune.artifacts.portable`
   (:func:`finetune.artifacts.target.load_model`); steps 3-5 are the one writer's
   (:func:`finetune.artifacts.writer.write_checkpoint`), which ``finetune eval`` of a checkpoint uses too;
3. it is written to a fresh hidden ``.tmp`` folder beside ``DIR``: safetensors + config (or a PEFT adapter and
   ``merge_check.safetensors`` for LoRA runs), the tokenizer, the checkpoint's resolved recipe;
4. a FRESH process (``python -m finetune.artifacts.reload``) loads that folder as any user would
   (``from_pretrained``; base + adapter for LoRA) and computes its logits on the probe the checkpoint recorded
   (:mod:`finetune.artifacts.probe`), under the recipe's ``train.mixed_precision`` as training computed them; they
   must equal the recorded ones within the
   tolerance of that compute precision (:func:`finetune.artifacts.probe.tolerance_rule` says what it allows). A
   checkpoint written before probes existed is loaded back the same way and compared with this process's model instead
   (noted: not verified by logits);
5. only then the manifest (with the verification) is written and the folder becomes ``DIR``; a failed check
   publishes nothing (:class:`finetune.artifacts.probe.ProbeMismatch`, exit code 1).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

from finetune.artifacts import checkpoint
from finetune.artifacts.probe import ProbeMismatch
from finetune.artifacts.target import open_target
from finetune.artifacts.writer import export_manifest, write_checkpoint
from finetune.config import outputs
from finetune.errors import FinetuneError, RunDirError
from finetune.storage import layout, rundir
from finetune.storage.choose import choose, skipped_lines


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
    run, is a protected place (see :func:`finetune.storage.rundir.check_location`), or holds anything but an earlier
    export (that one is replaced only with ``overwrite``)."""
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
           log: Callable[[str], None] = _stderr, report: Callable[[Exported], None] | None = None) -> Exported:
    """Export checkpoint ``name`` (None: the newest resumable one) of run ``target`` to ``out``; see the module
    docstring. Progress goes to ``log`` (stderr). ``report`` is called with the result once it is published (the
    CLI prints its ``exported`` line there): from the moment ``out`` holds this export until its report is done, a
    Ctrl+C no longer stops the command (:func:`_published_is_done`), so what is published, what is said and the exit
    code agree."""
    checkpoint.forbid_unpickling()
    run_dir, name = locate(target, name)
    run_id = rundir.run_id(run_dir)
    chosen = choose(run_dir, name, "export")
    for line in skipped_lines(chosen):
        log(f"note: {line}")
    info = chosen.info
    check_output(out, run_dir, overwrite)
    with _pruned_is_said(info.path, run_dir):
        where, cfg = open_target(info.path, [], trust_remote_code, info.manifest, run_id)  # this run's, intact
    outputs.check_not_input(out, outputs.recipe_inputs(cfg))
    log(f"loading {info.path.name} of {run_dir} ({layout.of(where.manifest).describe()}) ...")

    def mismatch(delta: float, tol: float, rule: str, recorded: bool) -> FinetuneError:
        against = "the logits recorded at the checkpoint" if recorded else "this process's model"
        return ProbeMismatch(f"export check failed: {info.path.name} reloaded from its export gives logits up to "
                             f"{delta:.2e} away from {against} (tolerance {tol:g}: {rule}); nothing was written to "
                             f"{out}: this checkpoint was not read correctly, please report it")

    source = {"checkpoint": str(info.path.resolve()), "layout": asdict(layout.of(where.manifest))}
    export_id = secrets.token_hex(8)
    with _published_is_done(out, export_id, log):
        with _pruned_is_said(info.path, run_dir):
            written = write_checkpoint(cfg, where, out, trust_remote_code=trust_remote_code, log=log,
                                       mismatch=mismatch, manifest={**export_manifest(run_id, info.step),
                                                                    EXPORT_ID: export_id, "source": source,
                                                                    "layout": where.manifest.get("layout")},
                                       recheck_out=True)
        if not written.expected.recorded:
            log(f"note: {info.path.name} recorded no probe logits (written before finetune recorded them): the "
                "export was loaded back in a fresh process but not verified against the training run's logits")
        done = Exported(out, info.path, info.step, written.kind, written.delta, written.tolerance,
                        written.expected.recorded)
        if report is not None:
            report(done)
    return done


EXPORT_ID = "export_id"  # the manifest key that tells this export from an earlier one at the same -o


def _holds(out: Path, export_id: str) -> bool:
    """Whether ``out`` holds the export ``export_id`` (it is published: the rename that publishes it is done)."""
    try:
        manifest = json.loads((out / rundir.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(manifest, dict) and manifest.get(EXPORT_ID) == export_id


@contextlib.contextmanager
def _published_is_done(out: Path, export_id: str, log: Callable[[str], None]) -> Iterator[None]:
    """Around an export's write, publication and report: a Ctrl+C that comes once ``out`` holds this export (which
    the SIGINT handler asks the folder, so the answer is the published state itself, whatever line the export was
    at) is noted instead of raised: the export is complete, so the command reports it and exits 0. Before that, a
    Ctrl+C stops the command as it would have (nothing published, exit 130). It used to stop the command at any
    moment: a Ctrl+C after the folder was published exited 130 and said nothing was published. Off the main
    thread, where no handler can be set (or under a handler Python did not set), nothing changes."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:  # None: not Python's to set
        yield
        return
    late: list[int] = []

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if _holds(out, export_id):
            late.append(signum)
        elif callable(previous):
            previous(signum, frame)  # the command's own handler: it raises the Ctrl+C
        elif previous != signal.SIG_IGN:
            signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if late:
        log(f"note: Ctrl+C came after {out} was published; the export is complete")


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
