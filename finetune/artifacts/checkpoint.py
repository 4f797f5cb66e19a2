"""Writing and loading checkpoints: a collective on every rank, published atomically by rank 0.

A checkpoint is written by every rank into ``checkpoints/step-000400.tmp/`` (``accelerator.save_state`` is a
collective) and renamed to ``step-000400/`` by rank 0 once every rank has finished. accelerate saves the model and
the optimizer (safetensors, ``torch.save`` read back with ``weights_only=True``, or the backend's sharded format);
the scheduler, the grad scaler, every rank's RNG state and (FSDP1) the whole optimizer state are our own state
files. Nothing is registered with accelerate's pickle-based ``custom_checkpoint_*.pkl`` path. What the folder
holds, its manifest and its verification are :mod:`finetune.storage.checkpoints` (files only, below this).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune import hooks
from finetune.backends import layout, restrict_checkpoint_loading
from finetune.backends.fullstate import keep_kernel_choice, kernel_choice
from finetune.config import to_yaml
from finetune.errors import RunDirError
from finetune.storage import restored, rundir
from finetune.storage.checkpoints import (
    latest_resumable,
    manifest,
    prune,
    read_state,
    tokenizer_fingerprint,
    write_state,
)
from finetune.storage.restored import rng_name
from finetune.storage.state import TrainState

if TYPE_CHECKING:
    from finetune.backends import Backend
    from finetune.runtime.context import RunContext


def rng_state() -> dict[str, Any]:
    """This process's RNG states: Python, numpy, torch CPU and (where present) CUDA."""
    import numpy as np  # lazy: heavy
    import torch  # lazy: heavy

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np  # lazy: heavy
    import torch  # lazy: heavy

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_name(rank: int) -> str:

    return rng_name(rank)


def save(ctx: RunContext, state: TrainState, objects: dict[str, Any]) -> Path:
    """Write a complete checkpoint of the current step on every rank; rank 0 publishes it atomically. ``ctx``: the
    run (its folder, recipe, tokenizer, backend and the classification labels recorded in the manifest,
    :func:`manifest`).

    ``objects``: name -> object with ``state_dict()`` / ``load_state_dict()`` (scheduler, grad scaler, ...); every
    rank calls ``state_dict()`` (it may be a collective), rank 0 writes it. A failed write (e.g. a full disk) removes
    the partial checkpoint, so the previous one stays the newest resumable checkpoint.

    Publishing (hashing every file into the manifest, then ``step-N.tmp`` -> ``step-N``) is rank 0's alone and,
    with several processes, runs on a thread while every rank trains on (:class:`_Publisher`): the hashes of a 7B
    model's ~90 GB of weights and optimizer state take minutes, and a barrier around them would make the other
    ranks wait past the collective timeout. The returned folder exists once :func:`wait_published` returns.
    """
    accelerator, cfg, run_dir = ctx.accelerator, ctx.cfg, ctx.run_dir
    final = rundir.step_dir(run_dir, state.step)
    tmp = final.with_name(final.name + rundir.TMP)
    main = accelerator.is_main_process
    if main:
        wait_published()  # the previous checkpoint is complete (or its failure raised) before this one starts
    try:
        if main:
            for stale in rundir.stale_checkpoint_dirs(run_dir):  # left by a crash: never complete, never resumed
                rundir.remove_checkpoint(stale)  # from; only what finetune wrote (resume refused the user's files)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp), safe_serialization=True)
        write_state(tmp, _rng_name(accelerator.process_index), rng_state())
        states = {name: obj.state_dict() for name, obj in objects.items()}
        hooks.fire("checkpoint_written", path=tmp)
        if main:
            for name, value in states.items():
                write_state(tmp, name, value)
            (tmp / rundir.TRAIN_STATE).write_text(json.dumps(asdict(state), indent=2))
            (tmp / rundir.RESOLVED).write_text(to_yaml(cfg))
        accelerator.wait_for_everyone()  # every rank's files are in tmp; nobody waits for what follows
    except Exception as exc:  # a full disk surfaces as OSError, SafetensorError or torch's RuntimeError
        if main:
            rundir.remove_checkpoint(tmp, written_now=True)
        raise RunDirError(_write_failure(f"checkpoint {final.name}", exc, run_dir)
                          + f"; then `finetune resume {run_dir}`") from exc
    if main:
        snapshot = TrainState(**asdict(state))  # as of this step: training moves on while a thread publishes
        tokenizer_sha256 = tokenizer_fingerprint(ctx.tokenizer)  # in this thread: a tokenizer is not for two at once
        world = accelerator.num_processes

        def record() -> dict[str, Any]:
            return manifest(cfg, snapshot, layout(ctx.backend.name, world), tokenizer_sha256, ctx.run_id, ctx.labels,
                            ctx.row)

        _PUBLISHER.start(lambda: _publish(tmp, final, record, cfg.checkpoint.keep_last), background=world > 1)
    accelerator.wait_for_everyone()
    return final


def _publish(tmp: Path, final: Path, record: Callable[[], dict[str, Any]], keep_last: int | None) -> None:
    """Rank 0: hash every file of a written checkpoint (and the data files, in ``record``) into its manifest,
    rename it complete, prune old ones."""
    run_dir = final.parent.parent
    try:
        hooks.fire("checkpoint_hashing", path=tmp)
        rundir.write_manifest(tmp, record())
        if final.exists():
            rundir.remove_checkpoint(final)
        tmp.rename(final)
        prune(run_dir, keep_last)
    except Exception as exc:
        rundir.remove_checkpoint(tmp, written_now=True)
        raise RunDirError(_write_failure(f"checkpoint {final.name}", exc, run_dir)
                          + f"; then `finetune resume {run_dir}`") from exc


class _Publisher:
    """The checkpoint rank 0 is publishing (at most one): run in this thread for one process, on a thread when
    other ranks run (they train on meanwhile: no barrier waits on hashing). Its failure is raised by :meth:`wait`:
    at the next save, or when the run ends (:func:`publishing`)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, publish: Callable[[], None], background: bool) -> None:
        self.wait()
        if not background:
            publish()
            return

        def run() -> None:
            try:
                publish()
            except BaseException as exc:  # raised in the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="finetune-publish-checkpoint")
        self._thread.start()

    def wait(self, raise_error: bool = True) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error


_PUBLISHER = _Publisher()


def wait_published() -> None:
    """Block until the checkpoint rank 0 is publishing is complete; raise its failure (a RunDirError)."""
    _PUBLISHER.wait()


@contextlib.contextmanager
def publishing() -> Iterator[None]:
    """Around a run on rank 0: on the way out, wait for its last checkpoint to be published, before the run's lock
    is released or the process exits. A publish failure fails the run; when the run fails anyway, its own error
    is the one raised."""
    try:
        yield
    except BaseException:
        _PUBLISHER.wait(raise_error=False)
        raise
    _PUBLISHER.wait()


def _write_failure(what: str, exc: Exception, run_dir: Path) -> str:
    """One line for a failed write: what, why (the library's words), the free space, and what was kept."""

    detail = (getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0] if str(exc).strip() else "")[:160]
    try:
        free = f"{shutil.disk_usage(run_dir).free / 2**20:.0f} MB free on that disk"
    except OSError:
        free = "free space unknown"
    previous = latest_resumable(run_dir)
    kept = f"{previous.path.name} stays the newest resumable checkpoint" if previous else "no checkpoint is kept"
    return (f"cannot write {what} ({type(exc).__name__}: {detail}; {free}); the partial write was removed and "
            f"{kept}; free space or fix permissions")


def _torch_optimizers(candidates: list[Any]) -> list[Any]:
    """The torch optimizers among ``candidates`` (accelerate's wrappers are unwrapped; DeepSpeed's own optimizers,
    which are not torch optimizers, keep their own rules)."""
    import torch  # lazy: heavy

    found = []
    for candidate in candidates:
        inner = getattr(candidate, "optimizer", candidate)
        if isinstance(inner, torch.optim.Optimizer) and all(inner is not seen for seen in found):
            found.append(inner)
    return found


def load(accelerator: Any, ckpt: Path, state: TrainState, objects: dict[str, Any], *,
         model_and_optimizer: bool = True, manifest: dict[str, Any] | None = None) -> None:
    """Load a verified checkpoint into the built objects on this rank. Model and optimizer come through accelerate
    (safetensors, ``weights_only`` loads, or the backend's sharded format); the rest from our JSON/safetensors.

    ``model_and_optimizer=False``: everything but the model and the optimizer (a portable resume has loaded those
    already, finetune.artifacts.portable); objects marked ``holds_optimizer_state`` are then skipped too. An object
    marked ``optional_in_checkpoint`` that a checkpoint does not hold (one written before it existed) is left as
    built. ``manifest``: the checkpoint's manifest when the caller has read it already (else read here)."""

    restored.check(ckpt, read_state, {name: objects[name].state_dict() for name in ("scheduler", "scaler")
                                      if name in objects}, manifest)  # before anything loads
    optimizers = _torch_optimizers([*getattr(accelerator, "_optimizers", []), *objects.values()])
    kernels = [kernel_choice(opt) for opt in optimizers]
    if model_and_optimizer:
        accelerator.load_state(str(ckpt))
    for name, obj in objects.items():
        if not model_and_optimizer and getattr(obj, "holds_optimizer_state", False):
            continue
        if getattr(obj, "optional_in_checkpoint", False) and not (ckpt / f"{name}.json").is_file():
            continue
        obj.load_state_dict(read_state(ckpt, name))
    for opt, choice in zip(optimizers, kernels, strict=True):
        keep_kernel_choice(opt, choice)
    rng = ckpt / f"{_rng_name(accelerator.process_index)}.json"
    if rng.is_file():  # a checkpoint of fewer ranks has no state for this rank: it keeps its own seed
        set_rng_state(read_state(ckpt, _rng_name(accelerator.process_index)))
    train_size = state.train_size
    state.load_state_dict(json.loads((ckpt / rundir.TRAIN_STATE).read_text(encoding="utf-8")))
    state.train_size = train_size


def forbid_unpickling(backend: Backend | None = None) -> None:
    """Make every checkpoint load in this process data-only, whatever library does it.

    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` turns every ``torch.load`` into ``weights_only=True`` (DeepSpeed and
    torch.distributed.checkpoint pass ``weights_only=False``); the backend's own format is restricted by
    :func:`finetune.backends.restrict_checkpoint_loading` (DCP's ``.metadata`` pickle, DeepSpeed's records)."""

    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    if backend is not None:

        restrict_checkpoint_loading(backend)
