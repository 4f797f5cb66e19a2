"""Hooks for subprocess resume tests, loaded through FINETUNE_HOOKS=tests.integration.kill_hooks.

FINETUNE_SLOW_CHECKPOINT=N: after the files of checkpoint step N are written (still under .tmp), create
``<tmp>/../slow-write-started`` and sleep, so the test can SIGKILL the process in the middle of a checkpoint write.
FINETUNE_SLOW_TOKENIZE=PATH: when a tokenization pass starts (in the worker that ticks first, with data.num_proc > 1),
write that process's pid to PATH and sleep, so the test can stop the command in the middle of tokenizing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from finetune import hooks


def _slow_checkpoint(path: Path) -> None:
    step = os.environ.get("FINETUNE_SLOW_CHECKPOINT")
    if step and path.name == f"step-{int(step):06d}.tmp":
        (path.parent / "slow-write-started").write_text(str(path))
        time.sleep(120)


hooks.register("checkpoint_written", _slow_checkpoint)


def _slow_tokenize(source: str) -> None:
    mark = os.environ.get("FINETUNE_SLOW_TOKENIZE")
    if mark:
        Path(mark).write_text(str(os.getpid()))
        time.sleep(120)


hooks.register("tokenizing", _slow_tokenize)
