"""The launcher process of a run on several processes: ``accelerate launch``, run inside a process of finetune's own so
that Ctrl+C or SIGTERM ends it as it ends a run of one process.

``finetune run`` (and ``resume``, ``generate``) replaces itself with ``python -P -m finetune.runtime.launcher ARGS``,
ARGS being ``accelerate launch``'s (:func:`finetune.runtime.launch.accelerate_argv`). This process is what
``accelerate launch`` was: it keeps the run's lock, runs torch elastic's agent, and is the parent of every rank (which
dies with it, :func:`finetune.runtime.launch.die_with_launcher`).

On SIGINT or SIGTERM the agent passes the signal on to every rank (each runs in a session of its own, out of a
terminal's reach), waits for them (they stop after the same step with a checkpoint, and rank 0 prints finetune's one
stop line), then re-raises the signal as torch's ``SignalException``: three warnings and some 30 lines of traceback,
exit 1. Here that exception ends the process with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM) and no
line of its own, and the agent's warnings while it handles the signal are not printed, except the one that says it
had to kill a rank that did not stop in time (that rank's checkpoint may be missing). Anything else, such as a rank
that fails, ends as ``accelerate launch`` ends it.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import NoReturn

from finetune.errors import describe

STOPS = (signal.SIGINT, signal.SIGTERM)
AGENT_LOGGER = "torch.distributed.elastic"  # the agent and the process context it starts the ranks with log here


class QuietStop(logging.Filter):
    """Drops the agent's records logged while it handles a stop signal (``stopping`` is an exception of that type
    being handled in the logging thread), but one that gives SIGKILL as an argument: a rank did not stop in time."""

    def __init__(self, stopping: type[BaseException]) -> None:
        super().__init__()
        self.stopping = stopping

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(AGENT_LOGGER) or not isinstance(sys.exc_info()[1], self.stopping):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        return any(arg is signal.SIGKILL for arg in args)  # "... forcefully exiting via %s", SIGKILL


def handlers_of(name: str) -> list[logging.Handler]:
    """The handlers a record of logger ``name`` reaches (its own and its ancestors', up to the first that does not
    propagate), or logging's last resort when there are none."""
    found: list[logging.Handler] = []
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        found += logger.handlers
        logger = logger.parent if logger.propagate else None
    return found or [h for h in [logging.lastResort] if h is not None]


def main(argv: list[str] | None = None) -> None:
    """Run ``accelerate launch ARGV`` (``sys.argv[1:]`` by default) in this process; exit 128 + signal on a stop."""
    try:
        launch(argv)
    except KeyboardInterrupt as exc:  # Ctrl+C before the agent took the signal over: no rank runs yet
        stopped(exc)


def stopped(exc: KeyboardInterrupt | int) -> NoReturn:
    """Exit as a stop before any rank ran: a Ctrl+C (``exc``, or its signal number) says what it stopped in the
    one line of one process (:func:`finetune.errors.describe`); a SIGTERM says nothing, as one process that it
    kills before training. 130 or 143."""
    if isinstance(exc, KeyboardInterrupt) or exc == signal.SIGINT:
        for line in describe(exc if isinstance(exc, KeyboardInterrupt) else KeyboardInterrupt())[1]:
            print(line, file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    sys.exit(128 + exc)


def launch(argv: list[str] | None) -> None:
    """``accelerate launch ARGV``, whose agent's stop signal is an exit with 128 + its number (see the module)."""
    # a stop while torch is imported waits for the import to end (an import cut in two leaves numpy broken: a
    # RecursionError of a thousand lines)
    deferred: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: deferred.append(signum)) for sig in STOPS}
    try:
        from accelerate.commands.launch import launch_command, launch_command_parser  # imports torch
        from torch.distributed.elastic.multiprocessing import SignalException  # imports torch
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if deferred:
        stopped(deferred[0])
    args = launch_command_parser().parse_args(argv)
    quiet = QuietStop(SignalException)
    for handler in handlers_of(AGENT_LOGGER):
        handler.addFilter(quiet)
    try:
        launch_command(args)
    except SignalException as exc:
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    if not sys.flags.safe_path:  # run by hand without -P (accelerate_argv passes it: no import of the schema here)
        from finetune.runtime.launch import isolate_sys_path

        isolate_sys_path()
    main()
