"""finetune's launcher process (finetune.runtime.launcher) around ``accelerate launch``: torch elastic's agent ends a
stop signal by raising it again as SignalException, after its warnings; the launcher exits 128 + the signal with no
line of its own and without those warnings, and leaves everything else as it was. Here the agent is played by a
stand-in for accelerate's ``launch_command`` that does what torch's agent does on a signal (log, then re-raise),
with torch's own exception; tests/distributed/test_launcher.py stops a real run of 2 processes."""

from __future__ import annotations

import logging
import signal
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import SignalException

from finetune.runtime import launcher

AGENT = logging.getLogger("torch.distributed.elastic.agent.server.api")  # the agent's own logger


class Kept(logging.Handler):
    """Keeps the messages of the records that reach it (after its filters)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def kept() -> Iterator[Kept]:
    """A handler where the agent's records arrive, as torch's own stderr handler does (the launcher filters every
    handler a record of the agent reaches)."""
    handler = Kept()
    owner = logging.getLogger("torch.distributed")
    owner.addHandler(handler)
    try:
        yield handler
    finally:
        owner.removeHandler(handler)


def agent_stopped_by(sig: signal.Signals) -> Callable[[Any], None]:
    """``launch_command`` as torch's agent ends on ``sig``: a warning while it runs, then the signal arrives as a
    SignalException, the agent warns while it shuts the ranks down, and raises it again."""

    def launch_command(args: Any) -> None:
        AGENT.warning("before the signal: a warning of the agent at work")
        try:
            raise SignalException(f"Process 1 got signal: {sig}", sigval=sig)
        except SignalException as exc:
            AGENT.warning("Received %s death signal, shutting down workers", exc.sigval)
            AGENT.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 7, sig, signal.SIGKILL)
            logging.getLogger("somebody.else").warning("not the agent's")
            raise

    return launch_command


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_exits_128_plus_it_without_the_agents_shutdown_warnings(
        sig: signal.Signals, kept: Kept, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("accelerate.commands.launch.launch_command", agent_stopped_by(sig))
    logging.getLogger("somebody.else").addHandler(kept)
    try:
        with pytest.raises(SystemExit) as done:
            launcher.main(["--num_processes", "2", "-m", "finetune.runtime.worker", "r.yaml"])
    finally:
        logging.getLogger("somebody.else").removeHandler(kept)
        for handler in launcher.handlers_of(launcher.AGENT_LOGGER):
            for quiet in [f for f in handler.filters if isinstance(f, launcher.QuietStop)]:
                handler.removeFilter(quiet)
    assert done.value.code == 128 + sig
    assert capsys.readouterr().err == ""  # no traceback, no line of the launcher's own: rank 0 says it
    assert kept.messages == [  # the shutdown's warnings are gone, but the one that says a rank was killed
        "before the signal: a warning of the agent at work",
        f"Unable to shutdown process 7 via {sig}, forcefully exiting via {signal.SIGKILL}",
        "not the agent's"]


def test_anything_else_ends_the_launcher_as_it_ends_accelerate_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that failed (torch's ChildFailedError, here any exception) goes on to accelerate's traceback and
    exit 1, unchanged."""

    def failed(args: Any) -> None:
        raise RuntimeError("a rank failed")

    monkeypatch.setattr("accelerate.commands.launch.launch_command", failed)
    with pytest.raises(RuntimeError, match="a rank failed"):
        launcher.main(["--num_processes", "2", "-m", "finetune.runtime.worker", "r.yaml"])


@pytest.mark.parametrize(("sig", "lines"), [(signal.SIGINT, 1), (signal.SIGTERM, 0)])
def test_a_stop_while_torch_is_imported_waits_for_the_import_then_ends_as_one_process(
        sig: signal.Signals, lines: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl+C while the launcher imports torch used to cut numpy's import in two (a RecursionError of a thousand
    lines). The signal now waits until the import is done; then nothing is launched and the launcher exits as one
    process stopped before training: Ctrl+C's one line and 130, or a silent 143 for SIGTERM."""
    launched: list[Any] = []

    class Importing(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            signal.raise_signal(sig)  # arrives in the middle of the import
            return launched.append

    monkeypatch.setitem(sys.modules, "accelerate.commands.launch", Importing("accelerate.commands.launch"))
    monkeypatch.setenv("FINETUNE_COMMAND", "finetune run")
    before = {s: signal.getsignal(s) for s in launcher.STOPS}
    with pytest.raises(SystemExit) as done:
        launcher.main(["--num_processes", "2", "-m", "finetune.runtime.worker", "r.yaml"])
    assert done.value.code == 128 + sig and launched == []
    said = capsys.readouterr().err.splitlines()
    assert len(said) == lines and all(line.startswith("interrupted (Ctrl+C): `finetune run` stopped") for line in said)
    assert {s: signal.getsignal(s) for s in launcher.STOPS} == before  # the process's own handlers again
