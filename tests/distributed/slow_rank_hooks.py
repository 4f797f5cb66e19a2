"""Hooks that make one process slow where it works alone, for tests/distributed/test_timeouts.py; loaded on every
rank through FINETUNE_HOOKS. Each writes what it did into the folder FINETUNE_SLOW_NOTES names (beside the run).

- FINETUNE_SLOW_TOKENIZE_S=S: a process that really tokenizes (not a cache hit) sleeps S seconds at its first pass,
  as a large dataset would keep it busy, and notes its global rank in ``tokenized-<rank>``.
- FINETUNE_SLOW_HASH_S=S: rank 0 sleeps S seconds before hashing a checkpoint into its manifest (``hashed``: the
  checkpoint, start and end times).
- Always: after step 1 every rank notes the timeout of its process group in ``pg-timeout-<rank>`` (seconds).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from finetune import hooks

NOTES = Path(os.environ.get("FINETUNE_SLOW_NOTES", "."))
RANK = os.environ.get("RANK", "0")


def _tokenizing(source: str) -> None:
    note = NOTES / f"tokenized-{RANK}"
    if not note.exists():  # once per process (a run tokenizes its train and eval files)
        note.write_text(json.dumps({"source": source, "pid": os.getpid()}))
        time.sleep(float(os.environ.get("FINETUNE_SLOW_TOKENIZE_S", "0")))


def _hashing(path: Path) -> None:
    started = time.time()
    time.sleep(float(os.environ.get("FINETUNE_SLOW_HASH_S", "0")))
    (NOTES / "hashed").write_text(json.dumps({"checkpoint": path.name, "start": started, "end": time.time()}))


def _after_step(trainer: Any) -> None:
    import torch
    import torch.distributed as dist

    if trainer.state.step == 1:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        seconds = backend.options._timeout.total_seconds()
        (NOTES / f"pg-timeout-{trainer.ctx.accelerator.process_index}").write_text(str(seconds))


hooks.register("tokenizing", _tokenizing)
hooks.register("checkpoint_hashing", _hashing)
hooks.register("after_step", _after_step)
