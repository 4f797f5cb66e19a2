"""Named test seams: points where a test injects behaviour without sleeps or branches in product code.

Product code calls :func:`fire` at a few points (``after_step``, ``checkpoint_written``); nothing is registered
in normal runs, so a fire is a dict lookup. Tests register callbacks in-process with :func:`register`, or for a
subprocess name a module in ``FINETUNE_HOOKS`` whose import registers them (e.g. a slow checkpoint write to
SIGKILL into).
"""

from __future__ import annotations

import importlib
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

_HOOKS: dict[str, list[Callable[..., None]]] = defaultdict(list)
_loaded_env = False


def register(point: str, fn: Callable[..., None]) -> None:
    """Call ``fn(**kwargs)`` whenever ``point`` fires."""
    _HOOKS[point].append(fn)


def clear() -> None:
    """Forget every registered callback (tests)."""
    _HOOKS.clear()


def fire(point: str, **kwargs: Any) -> None:
    """Run the callbacks registered for ``point`` (none in a normal run)."""
    global _loaded_env
    if not _loaded_env:
        _loaded_env = True
        for module in filter(None, os.environ.get("FINETUNE_HOOKS", "").split(",")):
            importlib.import_module(module)
    for fn in _HOOKS.get(point, ()):
        fn(**kwargs)
