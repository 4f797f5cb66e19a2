"""Graceful stop: the first SIGINT/SIGTERM asks the loop to stop at the next step boundary, with a checkpoint.

The loop all-reduces the request with the step's loss, so every rank stops after the same step and saves
together. A second SIGINT aborts at once (KeyboardInterrupt). The process then exits 128 + signal number
(130 for SIGINT, 143 for SIGTERM), as shells expect.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from finetune.errors import Aborted, Interrupted, ctrl_c

__all__ = ["Interrupted", "StopRequest"]


class StopRequest:
    """Set by the first SIGINT/SIGTERM; read by the loop after each optimizer step."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGTERM)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise ctrl_c(Aborted())  # second Ctrl+C: abort now, no checkpoint
        self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Install the handlers for the duration of training (main thread only), then restore the old ones."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
