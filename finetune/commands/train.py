"""``finetune run`` and ``finetune resume``: from a validated recipe (or a run to continue) to training, in this
process or under ``accelerate launch``.

The command line (finetune/cli.py) parses the flags and calls :func:`run` or :func:`resume`; this module composes
and validates the recipe, reads the data, creates and locks the run folder, and starts the worker (in this process,
or by replacing this process with the launcher). Nothing here imports torch at import time: ``--help`` and the other
light verbs import this module too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
import yaml

from finetune import backends, registry
from finetune.artifacts.checkpoint import publishing
from finetune.commands.plan import render
from finetune.config import Composed, compose, load_recipe, outputs, resources, to_yaml, validate
from finetune.config.schema import LaunchConfig, RecipeConfig, TrainConfig, batch_hint
from finetune.errors import RunDirError
from finetune.registry import SupportedModel
from finetune.runtime import launch, prepare, worker
from finetune.runtime.peft import describe_on_meta
from finetune.runtime.plan import build_plan
from finetune.storage import rundir, unstarted
from finetune.storage.resume import begin


def run(recipe: str, overrides: list[str] | None, *, output_dir: str | None = None, overwrite: bool = False,
        dry_run: bool = False, accelerate_config: str | None = None, num_processes: int | None = None) -> None:
    """``finetune run``: see the command's help."""
    if output_dir is not None:
        outputs.given(output_dir)  # `-o ''` (an unset variable) is a mistake, not the recipe's default
    flags = launcher_flags({"output_dir": output_dir, "accelerate_config": accelerate_config,
                            "num_processes": num_processes})
    cfg, composed = recipe_with_flags(recipe, overrides, **flags)
    row = registry.recipe_row(cfg)  # resolved once here; everything below is handed it
    if not launch.under_launcher():  # before the run dir exists: one machine creates it
        launch.check_one_machine(cfg)
    run_dir = Path(cfg.output_dir or "")
    resolved = run_dir / rundir.RESOLVED
    protected = protected_inputs(cfg, composed)
    if dry_run:
        rundir.check_location(run_dir, protected)
        typer.echo(to_yaml(cfg), nl=False)
        typer.echo(f"# run dir: {run_dir}")
        try:  # what the real run would refuse (an existing run without --overwrite, a foreign folder, a live run)
            rundir.check_creatable(run_dir, overwrite=overwrite, protected=protected)
        except RunDirError as exc:
            typer.echo(f"# the real run would be refused: {exc}")
            typer.echo(f"warning: the real run would be refused: {exc}", err=True)
        typer.echo(f"# global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accum "
                   f"{cfg.grad_accum} x {cfg.launch.num_processes} process(es)")
        plan = "in this process" if launch.in_process(cfg) else " ".join(launch.launch_argv(cfg, resolved))
        typer.echo(f"# would run: {plan}")
        typer.echo(effective_settings(cfg, row))
        typer.echo(peft_summary(cfg, row))
        # the memory plan builds the model on the meta device: the one dry-run step that loads torch
        typer.echo("\n".join(f"## {line}".rstrip() for line in render(build_plan(cfg, row=row)).splitlines()))
        return
    if not is_rank0():  # under a launcher the other ranks train from the validated recipe in memory
        start(cfg, resolved, None, allow_plugin=True)  # the recipe was named on this command line
        return
    # The run folder is created only once the run can start: its backend is installed, it would not be refused, and
    # the data reads (a bad row is one line here, with no folder left behind that would need --overwrite)
    launch.check_backend_installed(cfg)
    rundir.check_creatable(run_dir, overwrite=overwrite, protected=protected)
    inputs = prepare.inputs(cfg, row)
    for line in prepare.report(cfg, inputs.data, hits_only=True):  # a source tokenized now said so as it went
        typer.echo(line)
    for line in inputs.data.warnings(cfg.data.max_seq_len):
        typer.echo(line, err=True)
    made = unstarted.first_missing(run_dir)
    lock = rundir.create(run_dir, overwrite=overwrite, protected=protected, command=f"finetune run {recipe}")
    try:
        rundir.write_resolved(cfg, run_dir)
    except BaseException:
        unstarted.discard(run_dir, made)
        lock.release()
        raise
    # what fails in this process before the first step (the model, a LoRA target) takes the new folder with it
    start(cfg, resolved, lock, allow_plugin=True, inputs=inputs, unstarted=lambda: unstarted.discard(run_dir, made))


def resume(run_dir: Path, overrides: list[str] | None, *, from_: str | None = None, allow_config_change: bool = False,
           accelerate_config: str | None = None, num_processes: int | None = None,
           trust_remote_code: bool = False) -> None:
    """``finetune resume``: see the command's help."""
    flags = launcher_flags({"accelerate_config": accelerate_config, "num_processes": num_processes})
    extra = [f"launch.{k}={v}" for k, v in flags.items() if v is not None]
    plan, lock = begin(run_dir, [*(overrides or []), *extra], from_, allow_config_change, trust_remote_code,
                       is_main=is_rank0(), warn=lambda note: typer.echo(f"warning: {note}", err=True))
    if plan.finished:  # a finished run: one line, exit 0, nothing written
        typer.echo(plan.finished)
        return
    start(plan.cfg, run_dir / rundir.RESUMING, lock, plan.checkpoint.path, allow_config_change,
          allow_plugin=trust_remote_code)


FLAG_KEYS = {"output_dir": "output_dir", "accelerate_config": "launch.accelerate_config",
             "num_processes": "launch.num_processes"}  # a command-line flag -> the recipe key it stands for


def with_flags(overrides: list[str] | None, flags: dict[str, Any]) -> list[str]:
    """The positional overrides, then the CLI flags as the overrides they stand for."""
    return [*(overrides or []), *(f"{FLAG_KEYS[k]}={v}" for k, v in flags.items() if v is not None)]


def recipe_with_flags(recipe: str, overrides: list[str] | None, *, weights: bool = True,
                      **flags: Any) -> tuple[RecipeConfig, Any]:
    """Compose + validate; CLI flags are applied as the overrides they stand for (after the positional ones)."""
    return load_recipe(resources.resolve_recipe(recipe), with_flags(overrides, flags), weights=weights)


def protected_inputs(cfg: RecipeConfig, composed: Composed) -> list[outputs.Input]:
    """What a run dir may not be, hold or lie inside (so --overwrite can never reach it), each with the key that
    names it: everything the run reads (:func:`finetune.config.outputs.recipe_inputs`: the recipe files, model,
    data, reward models, plugins, accelerate config, caches). :func:`finetune.storage.rundir.check_location`
    refuses the run dir in one line, before anything is created, tokenized or deleted."""
    return outputs.recipe_inputs(cfg, composed.files)


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def plan_recipe(recipe: str, overrides: list[str] | None, **flags: Any) -> tuple[RecipeConfig, str | None]:
    """The recipe to plan, and a note when it was planned with another global batch: validated as for a run, except
    that a model folder may hold only config.json (the plan builds the model on the meta device from its config;
    weights are what a run needs, not a plan), and that a global batch the asked processes cannot split is planned
    at the next one they can (:func:`splittable_batch`): `finetune plan recipe.yaml --num-processes 8` answers the
    question it asks, what each of 8 ranks holds, where `finetune run` refuses that batch."""
    path, given = resources.resolve_recipe(recipe), with_flags(overrides, flags)
    composed = compose(path, given)
    batch = splittable_batch(composed.data)
    if batch is None:
        return validate(composed, weights=False), None
    planned, note = batch
    return validate(compose(path, [*given, f"train.global_batch_size={planned}"]), weights=False), note


DEFAULT_BATCH = {("train", "global_batch_size"): TrainConfig.model_fields["global_batch_size"].default,
                 ("train", "micro_batch_size"): TrainConfig.model_fields["micro_batch_size"].default,
                 ("launch", "num_processes"): LaunchConfig.model_fields["num_processes"].default}


def splittable_batch(recipe: dict[str, Any]) -> tuple[int, str] | None:
    """For a composed recipe whose ``train.global_batch_size`` is not a multiple of ``train.micro_batch_size`` x
    ``launch.num_processes``: the next global batch that is, and the note that says so (per-rank memory depends on
    the micro-batch, not the global batch); None when it splits, or when a value is not a positive integer (then
    validation names the key)."""
    def number(section: str, key: str) -> int | None:
        part = recipe.get(section)
        value = part.get(key, DEFAULT_BATCH[section, key]) if isinstance(part, dict) else DEFAULT_BATCH[section, key]
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    total, micro = number("train", "global_batch_size"), number("train", "micro_batch_size")
    procs = number("launch", "num_processes")
    if total is None or micro is None or procs is None or total % (micro * procs) == 0:
        return None
    step = micro * procs
    planned = -(-total // step) * step
    return planned, (f"planned with train.global_batch_size={planned}: {batch_hint(total, micro, procs)} "
                     "(a run refuses it; per-rank memory depends on the micro-batch only)")


def effective_settings(cfg: RecipeConfig, row: SupportedModel) -> str:
    """The backend settings the worker will use, as commented YAML."""
    accelerate = backends.accelerate_config(cfg.launch.accelerate_config)
    settings = backends.effective_settings(cfg, row, accelerate.settings)
    text = yaml.safe_dump(settings, sort_keys=False, default_flow_style=False)
    return "\n".join(f"# {line}" for line in [f"effective settings ({accelerate.path}):", *text.splitlines()])


def peft_summary(cfg: RecipeConfig, row: SupportedModel) -> str:
    """Resolved LoRA targets and trainable/total parameters (model built on the meta device); empty without LoRA."""
    if cfg.peft.method == "none":
        return ""
    text = yaml.safe_dump({"peft": describe_on_meta(cfg, row)}, sort_keys=False)
    return "\n".join(f"# {line}" for line in text.splitlines())


def start(cfg: RecipeConfig, resolved: Path, lock: rundir.RunLock | None, resume_from: Path | None = None,
          allow_change: bool = False, *, allow_plugin: bool, inputs: Any = None,
          unstarted: Callable[[], object] | None = None) -> None:
    """Train in this process (every rank, under a launcher), or replace this process with `accelerate launch`
    running the worker on every rank. The run's lock is held until training ends: released here, or kept by the
    launcher across exec until every rank has exited. Before a launch, this process fills the caches the ranks
    read (finetune.runtime.prepare): no rank then tokenizes or downloads alone inside the process group. ``inputs``:
    what ``prepare.inputs`` already gave this process (the data check of `finetune run`); ``unstarted``: called, with
    the lock still held, when training in this process fails (it removes a new run that trained nothing)."""
    if launch.in_process(cfg):
        try:
            with publishing():  # rank 0's last checkpoint is complete before the lock goes
                worker.run_worker(cfg, resume_from, allow_change, allow_plugin, inputs=inputs)
        except BaseException:
            if unstarted is not None:
                unstarted()
            raise
        finally:
            if lock is not None:
                lock.release()
        return
    launch.check_one_machine(cfg)
    launch.check_backend_installed(cfg)  # `finetune resume` (`run` checked before creating the run folder)
    if inputs is None:
        prepare.inputs(cfg, registry.recipe_row(cfg))  # resume: the front process's one look-up
    worker_args = ["--resume", str(resume_from)] if resume_from else []
    worker_args += ["--allow-config-change"] if allow_change else []
    worker_args += ["--allow-plugin"] if allow_plugin else []  # the workers read the resolved file: say so, explicitly
    argv = launch.launch_argv(cfg, resolved, worker_args)
    if lock is not None:
        lock.inherit()
    sys.stdout.flush()
    os.execvpe(argv[0], argv, launch.child_env())


def launcher_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """Under a launcher, what it started wins over the recipe (recorded in the resolved recipe)."""
    if not launch.under_launcher():
        return flags
    return {**flags, "num_processes": int(os.environ.get("WORLD_SIZE", "1")),
            "accelerate_config": backends.launcher_config_name(backends.detect())}
