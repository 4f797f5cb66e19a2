"""How a run is started: in this process, or re-launched through ``accelerate launch`` (run by finetune's own launcher
process, :mod:`finetune.runtime.launcher`).

Pure functions (no torch): the CLI prints the plan for ``--dry-run`` and executes it otherwise.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import sys
from pathlib import Path

from finetune import backends
from finetune.config.schema import RecipeConfig
from finetune.errors import COMMAND_ENV, ConfigError, command

LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_LAUNCHED")
LAUNCHER = "finetune.runtime.launcher"  # runs `accelerate launch` in-process: a stop signal is one line and 130/143


def isolate_sys_path() -> None:
    """``python -m finetune`` (and ``-m finetune.runtime.worker`` under accelerate launch) put the current folder first
    on ``sys.path``; the ``finetune`` console script does not. Drop it, so that a module named by a recipe
    (``model.plugin``) is imported only from what is installed or on PYTHONPATH, never from whatever folder, such as a
    run directory, the command happens to run in."""
    if sys.flags.safe_path:  # PYTHONSAFEPATH / -P: Python added no current folder; sys.path[0] is PYTHONPATH's
        return
    here = os.getcwd()
    if sys.path and sys.path[0] in ("", here):
        del sys.path[0]


def child_env() -> dict[str, str]:
    """The environment of every process finetune starts (``accelerate launch`` and, through it, every rank):
    ``PYTHONSAFEPATH`` keeps the current folder off their ``sys.path`` (``python -m finetune.runtime.launcher`` and
    torchrun's ``python -m finetune.runtime.worker`` would otherwise import a yaml.py or typer.py planted there);
    ``FINETUNE_COMMAND`` names the command they run for (``finetune run``), which a Ctrl+C line names."""
    return {**os.environ, "PYTHONSAFEPATH": "1", COMMAND_ENV: command()}


def die_with_launcher() -> None:
    """A rank started by ``accelerate launch`` dies with it (Linux ``PR_SET_PDEATHSIG``). The launcher holds the
    run's lock; ranks that outlived a SIGKILLed launcher would go on writing an unlocked run dir."""

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to arm
        return
    if os.getppid() == 1:  # the launcher died before the signal was armed
        os._exit(1)


def under_launcher(env: dict[str, str] | None = None) -> bool:
    """True when a launcher (accelerate launch, torchrun, SLURM via torchrun) already started this process."""
    env = dict(os.environ) if env is None else env
    return any(key in env for key in LAUNCHER_ENV)


def in_process(cfg: RecipeConfig, env: dict[str, str] | None = None) -> bool:
    """Train in this process: one process (a launcher would only cost threads), or already under a launcher."""
    return cfg.launch.num_processes == 1 or under_launcher(env)


def launch_argv(cfg: RecipeConfig, resolved: Path, worker_args: list[str] | None = None) -> list[str]:
    """The exact command line that runs the worker on every rank (``accelerate launch``, :func:`accelerate_argv`)."""
    return accelerate_argv(backends.accelerate_config(cfg.launch.accelerate_config), cfg.launch.num_processes,
                           "finetune.runtime.worker", [str(resolved), *(worker_args or [])])


def accelerate_argv(config: backends.AccelerateConfig | Path, num_processes: int, module: str,
                    args: list[str]) -> list[str]:
    """``accelerate launch`` running ``python -m module args`` on ``num_processes`` ranks with ``config`` (the
    training worker, or ``finetune generate``'s): as :func:`finetune.backends.accelerate_config` read it, or its
    file (read here when it matters). It runs inside :mod:`finetune.runtime.launcher`, which takes ``accelerate
    launch``'s own arguments (on Ctrl+C or SIGTERM it exits 130 or 143 with the ranks' one stop line, not torch
    elastic's traceback). With several processes, a config that names no ``main_process_port`` gets a free one
    (:func:`free_port`): accelerate's default, 29500, is one port per machine, so a second run started on the same
    machine failed with 'address already in use'."""
    if isinstance(config, Path) and num_processes > 1:
        config = backends.accelerate_config(str(config))
    path = config if isinstance(config, Path) else config.path
    named = isinstance(config, backends.AccelerateConfig) and config.names_port
    port = ["--main_process_port", str(free_port())] if num_processes > 1 and not named else []
    return [
        sys.executable, "-P", "-m", LAUNCHER,  # -P: no current folder on its sys.path
        "--config_file", str(path),
        "--num_processes", str(num_processes), *port,
        "-m", module, *args,
    ]


def free_port() -> int:
    """A TCP port no process listens on now (the kernel's pick for port 0), for one machine's rendezvous."""

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_backend_installed(cfg: RecipeConfig) -> None:
    """Refuse, in finetune's own front process and before a run folder exists, a launch whose accelerate config runs
    DeepSpeed where the ``deepspeed`` package is not installed: it is optional on machines whose image lacks it (too
    large, or not buildable offline), and ``accelerate launch`` would otherwise stop with an ImportError traceback.
    One process trains in this process whatever the config says (:func:`in_process`), so it needs no DeepSpeed."""
    if cfg.launch.num_processes == 1:
        return
    config = backends.accelerate_config(cfg.launch.accelerate_config)
    package = config.backend.package
    if package is not None and importlib.util.find_spec(package) is None:  # only DeepSpeed needs one
        raise ConfigError(f"launch.accelerate_config: {cfg.launch.accelerate_config} runs DeepSpeed "
                          f"({config.backend.name}), but deepspeed is not installed: pip install deepspeed, or use "
                          "launch.accelerate_config=ddp, fsdp1 or fsdp2")


def check_one_machine(cfg: RecipeConfig) -> None:
    """Refuse, in finetune's own front process, an accelerate config that spans several machines. Run on every
    machine, ``finetune run`` would have each of them create and lock the same run directory on the shared disk
    (the second refuses, or ``--overwrite`` deletes the first one's run). Under a launcher started on every machine
    only global rank 0 creates and locks it, so that is the way to start a multi-node run."""
    config = backends.accelerate_config(cfg.launch.accelerate_config)
    if config.machines > 1:
        raise ConfigError(
            f"launch.accelerate_config: {config.path} spans {config.machines} machines, which `finetune run` does not "
            f"start: run `accelerate launch --config_file {config.path} --machine_rank <this machine's rank> -m "
            "finetune run <recipe>` on every machine (only global rank 0 creates and locks the run directory; see "
            "accelerate_configs/multi_node_example.yaml)")
