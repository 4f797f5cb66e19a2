"""The one place where an exception becomes messages and an exit code (finetune.errors.run_main)."""

from __future__ import annotations

import errno

import pytest

from finetune.errors import (
    Aborted,
    CollapseError,
    ConfigError,
    Interrupted,
    NonFiniteError,
    RunDirError,
    command,
    ctrl_c,
    describe,
    run_main,
)


@pytest.mark.parametrize(("exc", "code", "lines"), [
    (ConfigError("a: bad\nb: worse"), 2, ["error: a: bad", "error: b: worse"]),
    (RunDirError("runs/x is in use by pid 7"), 2, ["error: runs/x is in use by pid 7"]),
    (NonFiniteError("training diverged"), 3, ["error: training diverged"]),
    (CollapseError("training collapsed"), 3, ["error: training collapsed"]),
    (Interrupted("stopped by signal after step 4", 143), 143, ["stopped by signal after step 4"]),
    (Aborted(), 130, ["aborted (second interrupt): no checkpoint written for the current step"]),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl"), 2,
     ["error: cannot use /runs/x/metrics.jsonl: no space left on the device; free some space"]),
    (PermissionError(errno.EACCES, "Permission denied", "/runs"), 2, ["error: cannot use /runs: permission denied"]),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run"), 2, ["error: cannot use /ro/run: read-only file system"]),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), 141, []),
    (MemoryError(), 1, ["error: out of memory; lower train.micro_batch_size or data.max_seq_len"]),
])
def test_each_way_a_command_ends_has_its_code_and_lines(exc: BaseException, code: int, lines: list[str]) -> None:
    assert describe(exc) == (code, lines)


def test_a_collective_that_timed_out_names_the_timeout_key_not_an_internal_error() -> None:
    code, lines = describe(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 6000ms for recv"))
    assert code == 1 and len(lines) == 1
    assert "launch.timeout_minutes" in lines[0] and "internal error" not in lines[0]
    assert "Timed out waiting 6000ms" in lines[0]


def test_an_unexpected_exception_is_one_line_that_says_how_to_see_more() -> None:
    code, lines = describe(ValueError("first line\nsecond line"))
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("error: internal error: ValueError: first line") and "FINETUNE_DEBUG=1" in lines[0]


def test_run_main_prints_and_exits(capsys, monkeypatch) -> None:
    monkeypatch.delenv("FINETUNE_DEBUG", raising=False)

    def fail() -> None:
        raise RunDirError("runs/x: nothing to resume")

    with pytest.raises(SystemExit) as done:
        run_main(fail)
    assert done.value.code == 2 and capsys.readouterr().err == "error: runs/x: nothing to resume\n"
    monkeypatch.setenv("FINETUNE_DEBUG", "1")
    with pytest.raises(RunDirError):  # the traceback is shown
        run_main(fail)


def test_ctrl_c_outside_the_loop_says_what_was_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["finetune", "export", "runs/q", "-o", "q"])
    code, lines = describe(KeyboardInterrupt())
    assert code == 130 and len(lines) == 1 and "`finetune export` stopped before it finished" in lines[0]


def test_a_process_finetune_started_names_the_command_it_runs_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's or the launcher's own command line is not what the user typed: the front process hands its command
    on (launch.child_env), and a Ctrl+C line names that."""
    monkeypatch.setattr("sys.argv", ["/x/finetune/runtime/launcher.py", "--config_file", "ddp.yaml"])
    monkeypatch.delenv("FINETUNE_COMMAND", raising=False)
    assert command() == "finetune ddp.yaml"  # what the process's own arguments would say
    monkeypatch.setenv("FINETUNE_COMMAND", "finetune resume")
    assert command() == "finetune resume"
    assert "`finetune resume` stopped before it finished" in describe(KeyboardInterrupt())[1][0]


@pytest.mark.parametrize("stop", [Interrupted("stopped by signal after step 4", 143), Aborted(), KeyboardInterrupt()])
def test_a_rank_that_does_not_say_stops_exits_with_their_code_in_silence(
        stop: BaseException, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """run_main(say_stops=False): a signal's stop (Interrupted, finetune's own Ctrl+C) is its exit code and no line;
    anything else, a KeyboardInterrupt that some code raised itself included, still says what it is."""
    monkeypatch.delenv("FINETUNE_DEBUG", raising=False)

    def stopped() -> None:
        raise ctrl_c(stop) if isinstance(stop, KeyboardInterrupt) else stop

    with pytest.raises(SystemExit) as done:
        run_main(stopped, say_stops=False)
    assert done.value.code == describe(stop)[0] and capsys.readouterr().err == ""

    def failed() -> None:
        raise ConfigError("a: bad")

    def raised_by_a_plugin() -> None:
        raise KeyboardInterrupt  # not a signal finetune took

    for fail, said in ((failed, ["error: a: bad"]), (raised_by_a_plugin, describe(KeyboardInterrupt())[1])):
        with pytest.raises(SystemExit):
            run_main(fail, say_stops=False)
        assert capsys.readouterr().err.splitlines() == said


def test_a_full_disk_behind_a_library_error_is_one_line_exit_2() -> None:
    """safetensors and torch re-raise a full disk as their own error: still one line, exit 2."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/out/.q.tmp/model.safetensors")
        except OSError as exc:
            raise RuntimeError("failed to write the file") from exc
    except RuntimeError as wrapped:
        assert describe(wrapped) == (2, ["error: cannot use /out/.q.tmp/model.safetensors: no space left on the "
                                         "device; free some space"])
    code, lines = describe(RuntimeError("SafetensorError: Error while serializing: IoError(Os { code: 28, kind: "
                                        "StorageFull, message: \"No space left on device\" })"))
    assert code == 2 and lines == ["error: cannot use a file: no space left on the device; free some space"]


def test_a_closed_pipe_never_stops_a_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """stdout's reader goes away (`| head -1`): the command goes on to its end and exits 0."""
    import os
    import sys

    read, write = os.pipe()
    os.close(read)
    monkeypatch.setattr(sys, "stdout", os.fdopen(write, "w", buffering=1))
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # run_main wraps both: put them back after the test
    done = []

    def command() -> None:
        for step in range(3):
            print(f"step {step}", flush=True)
            done.append(step)

    with pytest.raises(SystemExit) as info:
        run_main(lambda: (command(), sys.exit(0)))
    assert info.value.code == 0 and done == [0, 1, 2]


def test_ctrl_c_that_typer_turns_into_exit_130_still_says_what_stopped(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Typer catches KeyboardInterrupt and exits 130 without a word; run_main still prints the line."""
    import signal
    import sys
    import time

    monkeypatch.setattr(sys, "argv", ["finetune", "export", "runs/q", "-o", "q"])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "an earlier test left its SIGINT handler"

    def typer_like() -> None:
        try:
            signal.raise_signal(signal.SIGINT)  # to this (the main) thread, not any thread of the process (os.kill)
            time.sleep(5)
        except KeyboardInterrupt:
            sys.exit(130)

    with pytest.raises(SystemExit) as info:
        run_main(typer_like)
    err = capsys.readouterr().err
    assert info.value.code == 130 and "`finetune export` stopped before it finished" in err, err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
