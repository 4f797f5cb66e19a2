"""Hooks for subprocess resume tests, loaded through FINETUNE_HOOKS=tests.integration.kill_hooks.

FINETUNE_SLOW_CHECKPOINT=N: after the files of checkpoint step N are written (still under .tmp), create
``<tmp>/../slow-write-started`` and sleep, so the test can SIGKILL the process in the middle of a checkpoint write.
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
