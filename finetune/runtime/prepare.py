"""What a run reads before its process group exists: the model's hub files, the tokenizer and the tokenized data.

Inside a process group every collective waits at most ``launch.timeout_minutes`` for the slowest rank. Work one
process does alone must therefore never run while the others wait in a collective: tokenizing (about 1,000 chat
rows/s here, so 16 minutes for a million rows) or downloading a model's weights. :func:`inputs` does it first:

- ``finetune run`` / ``resume`` with several processes: the front process calls it before it execs
  ``accelerate launch``, so every rank finds the hub and datasets caches filled (and a bad data row is one error
  line before anything is launched).
- On every rank, before the Accelerator (and so the process group) is created: under a user's launcher (no front
  process of ours) this is where the work happens. The first process to take a file lock beside the datasets cache
  (``finetune-locks/<key>.lock``, keyed by the data, the model and this code; :mod:`finetune.runtime.cachelock`)
  tokenizes; the others wait on that lock, not in a collective, then read the cache. A cache on a disk that every
  node shares is filled once, a per-node cache once per node. The lock is the process's own (its tokenizing workers
  never hold it, and they die with it), so a killed process leaves nothing that blocks the next one.
- ``finetune preprocess``: only this, ahead of any run (:func:`report` says per source whether it was tokenized
  now or read from the cache), so a later ``finetune run`` finds the caches filled.

A SIGTERM while this runs stops it with one line and exit code 143, as Ctrl+C does with 130 (no training loop is
there yet to stop at a step boundary); nothing half-written is published, since ``datasets`` moves a cache file into
place only once it is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from finetune.config import RecipeConfig
from finetune.errors import Interrupted
from finetune.objectives import objective
from finetune.registry import SupportedModel
from finetune.runtime import cachelock
from finetune.runtime.teacher import check_vocabulary

if TYPE_CHECKING:  # the data package imports numpy: not at CLI start-up
    from finetune.data import DataBundle

# Files transformers never reads for a PyTorch model; left out of a hub download (Llama's original/ holds a second
# copy of the weights in Meta's format).
NOT_READ = ("*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.ot", "*.tflite", "*.mlmodel", "original/*")


@dataclass
class Inputs:
    """The tokenizer, a vision-language row's image inputs (else None) and the tokenized splits, and the row they
    were read for (registry.recipe_row: the worker builds the model of that row, resolved once per process)."""

    tokenizer: Any
    images: Any
    data: DataBundle
    row: SupportedModel


def inputs(cfg: RecipeConfig, row: SupportedModel) -> Inputs:
    """Download ``model.path`` when it is a hub id, build the tokenizer, load and tokenize the data; the first
    process to get here does the work while the others wait on a file lock, then read the caches."""
    from finetune.data import PromptOptions, load_splits  # imports numpy: not at CLI start-up
    from finetune.runtime.modeling import build_tokenizer, image_inputs  # imports torch

    def load() -> Inputs:
        download(cfg)
        tokenizer = build_tokenizer(cfg.model, row)
        if (record := objective(cfg.task)) is not None and record.teacher:  # before any data is read
            check_vocabulary(cfg, tokenizer)
        images = image_inputs(tokenizer, row)
        data = load_splits(cfg.data, tokenizer, images=images, seed=cfg.train.seed, prompt=PromptOptions.of(cfg))
        return Inputs(tokenizer, images, data, row)

    lock, done = _lock_files(cfg)
    what = ", ".join(dict.fromkeys(s.path for s in (*cfg.data.train_sources(), *cfg.data.eval_sources())))
    with _stops_on_sigterm():
        # waits while another process fills the caches; its failure leaves `done` unwritten
        with cachelock.held(lock, what):
            if not cachelock.is_done(done):
                result = load()
                cachelock.mark_done(done)
                return result
        return load()  # the caches are warm: every process reads them at once


STOPPED = ("terminated (SIGTERM) while the data was read and tokenized; nothing half-written was published (the next "
           "run or `finetune preprocess` of this data goes on from the complete cache entries)")


class _Terminated(BaseException):
    """A SIGTERM while the inputs are read. Not an Exception: no ``except Exception`` on its way up (``datasets``,
    the data loaders) may take it for a bad file; :func:`_stops_on_sigterm` turns it into its one line."""


def _end_now() -> None:
    """Say :data:`STOPPED` and end this process at once, skipping the unwinding. Only while tokenizing workers run:
    a SIGTERM sent to the whole process group (``timeout``, Slurm's scancel, systemd) kills an idle worker while it
    holds the lock of the pool's task queue, and the pool's teardown then waits for that lock for ever. The workers
    and the pool's manager die with this process (:func:`finetune.data.batched.workers_die_with_this_process`), the
    kernel drops the cache lock, and a cache file is published only complete."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(STOPPED, file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGTERM)


@contextlib.contextmanager
def _stops_on_sigterm() -> Iterator[None]:
    """Inside, a SIGTERM stops the work with one line and exit code 143 (:data:`STOPPED`) instead of killing the
    process silently; a second one while it unwinds is ignored. Only where nobody else handles SIGTERM (the main
    thread, the default action): a launcher's or the training loop's own handler is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signalled: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        if signalled:
            return
        signalled.append(signum)
        from finetune.data import batched  # lazy: imports numpy (already imported: the data is being read)

        if batched.workers_running():  # see _end_now
            _end_now()
        raise _Terminated()

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except _Terminated:
        raise Interrupted(STOPPED, 128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def report(cfg: RecipeConfig, data: DataBundle, *, hits_only: bool = False) -> list[str]:
    """One line per tokenized source (``finetune preprocess``): its key and name, its samples, and whether they
    were tokenized now (and cached for later runs) or read from the cache an earlier run filled; first, a line per
    source whose format was read from its columns. ``hits_only``:
    the lines of sources read from the cache (``finetune run``: a source tokenized now already said so while it
    was tokenized)."""
    from finetune.data import source_name  # imports numpy: not at CLI start-up

    lines = list(data.detected)  # what each source whose format was left out was read as: said on every start
    if data.stream is not None and not hits_only:  # streaming: nothing to cache; the first rows were read to check them
        lines.append(f"data.train: streamed ({', '.join(s.name for s in data.stream.sources)}), tokenized while "
                     "training, nothing cached")
    for key, split, parts, sources in (("data.train", None if data.stream else data.train, data.train_parts,
                                        cfg.data.train_sources()),
                                       ("data.eval", data.eval, data.eval_parts, cfg.data.eval_sources())):
        if split is None:
            continue
        for name, source, tokenized in ([(p.key, p.name, p.tokenized) for p in parts]
                                        or [(key, source_name(sources[0]), split)]):
            if hits_only and not tokenized.cached:
                continue
            count = len(tokenized.dataset)
            how = "read from the cache" if tokenized.cached else "tokenized now (cached)"
            lines.append(f"{name} {source}: {count} sample{'s' * (count != 1)}, {how}")
    return lines


def hub_id(cfg: RecipeConfig) -> str | None:
    """``model.path`` when it names a hub repository (not a local folder, not ``pkg://``), else None."""
    path = cfg.model.path
    if not path or "://" in path or Path(path).expanduser().exists():
        return None
    return path


def ignore_patterns(files: list[str]) -> list[str]:
    """What a download of a repository with these files leaves out: formats transformers does not read, and the
    ``.bin`` weights when safetensors are there (transformers reads those)."""
    if any(name.endswith(".safetensors") for name in files):
        return [*NOT_READ, "*.bin", "*.pt", "*.pth"]
    return list(NOT_READ)


def download(cfg: RecipeConfig) -> None:
    """Fill the hub cache with ``model.path``'s files (nothing for a local folder or offline): the weights are then
    read from disk inside the process group, never downloaded there."""
    repo = hub_id(cfg)
    if repo is None:
        return
    from huggingface_hub import constants, list_repo_files, snapshot_download  # lazy: heavy

    if constants.HF_HUB_OFFLINE:  # transformers reads the cache, or says what is missing
        return
    from finetune.runtime.modeling import loading  # lazy: imports torch

    with loading("model", repo):
        snapshot_download(repo, ignore_patterns=ignore_patterns(list_repo_files(repo)))


def _lock_files(cfg: RecipeConfig) -> tuple[Path, Path]:
    """The lock that one process fills the caches under, and the file that says it has, for this recipe's inputs:
    beside the datasets cache, keyed by the data settings, each local data file (path, size, mtime, ctime), the
    model and the tokenization code. A key that misses a change costs only parallel work, never a wrong cache: the
    datasets cache has its own keys."""
    from datasets import config as datasets_config  # lazy: heavy

    from finetune.data.tokenize import CODE_VERSION  # lazy: imports numpy

    files = []
    for source in (*cfg.data.train_sources(), *cfg.data.eval_sources()):
        path = Path(source.path)
        stat = path.stat() if path.is_file() else None
        # the ctime too: a file rewritten with its old mtime is read again by every process (finetune.data.sources)
        files.append([source.path, stat.st_size if stat else None, stat.st_mtime_ns if stat else None,
                      stat.st_ctime_ns if stat else None])
    key = json.dumps([cfg.data.model_dump(mode="json"), files, cfg.model.model_dump(mode="json"), cfg.task,
                      CODE_VERSION], sort_keys=True)
    folder = Path(datasets_config.HF_DATASETS_CACHE) / "finetune-locks"
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    return folder / f"{name}.lock", folder / f"{name}.done"
