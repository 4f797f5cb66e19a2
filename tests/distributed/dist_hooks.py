"""Hooks for 2-process tests, loaded on every rank through FINETUNE_HOOKS=tests.distributed.dist_hooks.

- Always: after the first optimizer step each rank writes <run_dir>.rank-<i>.json (beside the run dir, which is
  finetune's alone) with what really runs
  (process count, distributed type, ZeRO stage / FSDP version, whether parameters are sharded), because a wrong
  set-up on CPU does not fail: it silently trains two independent single-process jobs, or DDP.
- FINETUNE_TERM_AT_STEP=N: rank 0 sends itself SIGTERM after step N (all ranks then stop after step N+1).
- FINETUNE_KILL_RANK=R:N: rank R SIGKILLs itself after step N.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from finetune import hooks
from tests.distributed.paths import side_file


def _local_param_numel(model: Any) -> int:
    """Parameter elements held by this rank (the full count unless parameters are sharded)."""
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3 partitioned parameter
            total += p.ds_tensor.numel()
        elif hasattr(p, "to_local"):  # FSDP2 DTensor
            total += p.to_local().numel()
        else:  # FSDP1 use_orig_params: a view of this rank's shard (possibly empty)
            total += p.numel()
    return total


def _after_step(trainer: Any) -> None:
    acc, step = trainer.ctx.accelerator, trainer.state.step
    if step == 1:
        facts = {
            "rank": acc.process_index, "num_processes": acc.num_processes,
            "distributed_type": str(acc.distributed_type), "backend": trainer.ctx.backend.name,
            "zero_stage": getattr(getattr(acc.state, "deepspeed_plugin", None), "zero_stage", None),
            "fsdp_version": getattr(getattr(acc.state, "fsdp_plugin", None), "fsdp_version", None),
            "local_param_numel": _local_param_numel(trainer.model),
        }
        side_file(trainer.ctx.run_dir, f"rank-{acc.process_index}.json").write_text(json.dumps(facts))
    if os.environ.get("FINETUNE_TERM_AT_STEP") == str(step) and acc.process_index == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    kill = os.environ.get("FINETUNE_KILL_RANK")
    if kill and kill == f"{acc.process_index}:{step}":
        side_file(trainer.ctx.run_dir, "killed-at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


hooks.register("after_step", _after_step)
