"""finetune.runtime.signals: the first SIGINT/SIGTERM asks the loop to stop (exit 128 + the signal's number), a second
Ctrl+C aborts at once, and the handlers a run found are back when it ends. The worker's exit line for a stopped run
is test_stop_message.py."""

from __future__ import annotations

import signal

import pytest

from finetune.errors import Aborted
from finetune.runtime.signals import StopRequest


def test_the_first_signal_asks_to_stop_and_the_old_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopRequest().installed() as stop:
        assert not stop.requested
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.exit_code == 143
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_second_ctrl_c_aborts_at_once() -> None:
    with StopRequest().installed() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.exit_code == 130
        with pytest.raises(Aborted):
            signal.raise_signal(signal.SIGINT)
