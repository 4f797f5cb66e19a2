"""The few recipe fields a task adapter reads, as a plain namespace: shared by the unit tests of the task modules
(tests/unit/test_causal_lm.py, test_classification.py), which build tasks without a validated recipe."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def make_cfg(metrics: list[str] | None = None, max_new_tokens: int = 8, **train: int) -> Any:
    """The few recipe fields the tasks read."""
    return SimpleNamespace(
        eval=SimpleNamespace(metrics=metrics or [], max_new_tokens=max_new_tokens, batch_size=2),
        train=SimpleNamespace(**{"global_batch_size": 4, "micro_batch_size": 2, "seed": 0, **train}),
        data=SimpleNamespace(shuffle=True, packing=False, num_workers=None),
    )
