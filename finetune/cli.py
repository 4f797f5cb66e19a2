"""The ``finetune`` command line.

This module imports nothing heavy: ``--help``, ``config``, ``models``, ``recipes`` and ``run --dry-run`` never
load torch. Training and evaluation import the worker lazily. Every user mistake raises a FinetuneError that
:func:`main` prints as one line per problem with exit code 2 (``FINETUNE_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from finetune.config import RESOLVED_NAME, load_recipe, to_yaml, write_resolved
from finetune.config.compose import recipes_dir
from finetune.config.schema import RecipeConfig
from finetune.errors import FinetuneError, RunDirError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Config-driven fine-tuning of Hugging Face models. Start with: finetune run recipes/quickstart.yaml",
)

Overrides = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. train.max_steps=50")]


def _echo_err(message: str) -> None:
    typer.echo(message, err=True)


def _recipe_with_flags(recipe: Path, overrides: list[str] | None, **flags: Any) -> tuple[RecipeConfig, Any]:
    """Compose + validate; CLI flags are applied as the overrides they stand for (after the positional ones)."""
    mapping = {"output_dir": "output_dir", "accelerate_config": "launch.accelerate_config",
               "num_processes": "launch.num_processes"}
    extra = [f"{mapping[k]}={v}" for k, v in flags.items() if v is not None]
    return load_recipe(recipe, [*(overrides or []), *extra])


def _run_dir_has_results(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (RESOLVED_NAME, "checkpoints", "final", "metrics.jsonl"))


@app.command()
def run(
    recipe: Annotated[Path, typer.Argument(help="recipe YAML")],
    overrides: Overrides = None,
    output_dir: Annotated[str | None, typer.Option("-o", "--output-dir", help="run directory")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing run directory")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the composed recipe and plan, then exit")] = False,
    accelerate_config: Annotated[str | None, typer.Option(help="name in accelerate_configs/ or a path")] = None,
    num_processes: Annotated[int | None, typer.Option(help="processes (data-parallel ranks)")] = None,
) -> None:
    """Train a recipe: compose, validate, write <output_dir>/recipe.resolved.yaml, then train."""
    from finetune import launch

    flags = _launcher_flags({"output_dir": output_dir, "accelerate_config": accelerate_config,
                             "num_processes": num_processes})
    cfg, _ = _recipe_with_flags(recipe, overrides, **flags)
    run_dir = Path(cfg.output_dir or "")
    resolved = run_dir / RESOLVED_NAME
    if dry_run:
        typer.echo(to_yaml(cfg), nl=False)
        typer.echo(f"# run dir: {run_dir}")
        typer.echo(f"# global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accum "
                   f"{cfg.grad_accum} x {cfg.launch.num_processes} process(es)")
        plan = "in this process" if launch.in_process(cfg) else " ".join(launch.launch_argv(cfg, resolved))
        typer.echo(f"# would run: {plan}")
        typer.echo(_effective_settings(cfg))
        typer.echo(_peft_summary(cfg))
        return
    is_rank0 = os.environ.get("RANK", "0") == "0"
    if is_rank0 and _run_dir_has_results(run_dir):
        if not overwrite:
            raise RunDirError(f"{run_dir} already holds a run; pass --overwrite to replace it, -o DIR for a new one, "
                              f"or `finetune resume {run_dir}` to continue it")
        shutil.rmtree(run_dir)
    if is_rank0:
        write_resolved(cfg, run_dir)
    _start(cfg, resolved)


def _effective_settings(cfg: RecipeConfig) -> str:
    """The backend settings the worker will use, as commented YAML."""
    from finetune.backends import effective_settings
    from finetune.config.validate import accelerate_config_path
    from finetune.registry import get_model

    path = accelerate_config_path(cfg.launch.accelerate_config)
    data = yaml.safe_load(path.read_text()) if path else {}
    settings = effective_settings(cfg, get_model(cfg.model.type), data or {})
    text = yaml.safe_dump(settings, sort_keys=False, default_flow_style=False)
    return "\n".join(f"# {line}" for line in [f"effective settings ({path}):", *text.splitlines()])


def _peft_summary(cfg: RecipeConfig) -> str:
    """Resolved LoRA targets and trainable/total parameters (model built on the meta device); empty without LoRA."""
    if cfg.peft.method == "none":
        return ""
    from finetune.peft import describe_on_meta
    from finetune.registry import get_model

    text = yaml.safe_dump({"peft": describe_on_meta(cfg, get_model(cfg.model.type))}, sort_keys=False)
    return "\n".join(f"# {line}" for line in text.splitlines())


def _start(cfg: RecipeConfig, resolved: Path, resume_from: Path | None = None, allow_change: bool = False) -> None:
    """Train in this process (every rank, under a launcher), or replace this process with `accelerate launch`
    running the worker on every rank."""
    from finetune import launch

    if launch.in_process(cfg):
        from finetune.worker import execute

        execute(cfg, resume_from, allow_change)
        return
    worker_args = ["--resume", str(resume_from)] if resume_from else []
    worker_args += ["--allow-config-change"] if allow_change else []
    argv = launch.launch_argv(cfg, resolved, worker_args)
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def _launcher_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """Under a launcher, what it started wins over the recipe (recorded in the resolved recipe)."""
    from finetune import launch
    from finetune.backends import detect, launcher_config_name

    if not launch.under_launcher():
        return flags
    return {**flags, "num_processes": int(os.environ.get("WORLD_SIZE", "1")),
            "accelerate_config": launcher_config_name(detect())}


@app.command()
def resume(
    run_dir: Annotated[Path, typer.Argument(help="the run directory (runs/<name>)")],
    overrides: Overrides = None,
    from_: Annotated[str | None, typer.Option("--from", help="checkpoint name, e.g. step-000100")] = None,
    allow_config_change: Annotated[bool, typer.Option(
        "--allow-config-change", help="continue although the recipe, data or tokenizer changed (logged)")] = False,
    accelerate_config: Annotated[str | None, typer.Option(help="name in accelerate_configs/ or a path")] = None,
    num_processes: Annotated[int | None, typer.Option(help="processes (data-parallel ranks)")] = None,
) -> None:
    """Continue a run exactly from its newest complete checkpoint (or --from), with its stored recipe."""
    from finetune import resume as resume_plan
    from finetune.tracking import TRAIN_LOG_FILE, truncate_metrics

    flags = _launcher_flags({"accelerate_config": accelerate_config, "num_processes": num_processes})
    extra = [f"launch.{k}={v}" for k, v in flags.items() if v is not None]
    plan = resume_plan.plan(run_dir, [*(overrides or []), *extra], from_, allow_config_change)
    resolved = run_dir / RESOLVED_NAME
    if os.environ.get("RANK", "0") == "0":
        step = plan.checkpoint.step or 0
        dropped = truncate_metrics(run_dir, step)
        notes = [f"resume from {plan.checkpoint.path.name} (step {step}); dropped {dropped} metrics rows logged "
                 "after it", *(f"resume: changed {c} (allowed)" for c in plan.changes),
                 *(f"resume: layout {c}" for c in plan.layout_changes)]
        with (run_dir / TRAIN_LOG_FILE).open("a", encoding="utf-8") as log:
            log.writelines(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {note}\n" for note in notes)
        write_resolved(plan.cfg, run_dir)
    _start(plan.cfg, resolved, plan.checkpoint.path, allow_config_change)


@app.command("ls")
def ls_(run_dir: Annotated[Path, typer.Argument(help="the run directory (runs/<name>)")]) -> None:
    """List a run's checkpoints: step, samples seen, resumable (and why not), size, time."""
    from finetune import checkpoint

    root = run_dir / checkpoint.CHECKPOINTS
    if not (run_dir / RESOLVED_NAME).is_file():
        raise RunDirError(f"{run_dir}: not a run directory (no {RESOLVED_NAME})")
    paths = sorted(root.glob("step-*")) if root.is_dir() else []
    if not paths:
        typer.echo(f"{run_dir}: no checkpoints")
        return
    typer.echo(f"{'checkpoint':<18} {'step':>8} {'samples':>10}  {'resumable':<40} {'size':>9}  created")
    for path in paths:
        if path.name.endswith(".tmp"):
            typer.echo(f"{path.name:<18} {'-':>8} {'-':>10}  {'no (incomplete write, ignored)':<40}")
            continue
        info = checkpoint.inspect(path)
        status = "yes" if info.resumable else f"no ({info.reason})"
        typer.echo(f"{path.name:<18} {info.step if info.step is not None else '-':>8} "
                   f"{info.samples_seen if info.samples_seen is not None else '-':>10}  {status:<40} "
                   f"{info.size_bytes / 2**20:>7.1f}MB  {info.created or '-'}")


@app.command("eval")
def eval_(
    target: Annotated[Path, typer.Argument(help="a run dir, a checkpoint dir, or an exported model dir")],
    as_json: Annotated[bool, typer.Option("--json", help="print the metrics as one JSON object")] = False,
    overrides: Overrides = None,
) -> None:
    """Evaluate a run's final model, a checkpoint, or an exported model on the recipe's eval set."""
    from finetune.evaluation import evaluate_target

    metrics = evaluate_target(target, overrides or [])
    if as_json:
        typer.echo(json.dumps(metrics, sort_keys=True))
    else:
        for key, value in metrics.items():
            typer.echo(f"{key:>24}  {value:.4f}" if isinstance(value, float) else f"{key:>24}  {value}")


@app.command()
def merge(
    target: Annotated[Path, typer.Argument(help="a LoRA run dir, its final/ adapter, or an adapter checkpoint")],
    output: Annotated[Path, typer.Option("-o", "--output", help="where the merged model is written")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing output dir")] = False,
) -> None:
    """Merge a LoRA adapter into its base model (safetensors), verifying the logits before keeping it."""
    from finetune.merge import merge as merge_adapter

    merge_adapter(target, output, overwrite, log=typer.echo)


def _render_provenance(data: Any, provenance: dict[str, str], prefix: str = "", indent: int = 0) -> list[str]:
    lines = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        pad = "  " * indent
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{key}:")
            lines.extend(_render_provenance(value, provenance, dotted + ".", indent + 1))
        else:
            text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...")
            text = text.removesuffix("...").strip()
            lines.append(f"{pad}{key}: {text}".ljust(60) + f"  # {provenance.get(dotted, 'default')}")
    return lines


@app.command()
def config(
    recipe: Annotated[Path, typer.Argument(help="recipe YAML")],
    overrides: Overrides = None,
    provenance: Annotated[bool, typer.Option("--provenance", help="say which file/override set each key")] = False,
) -> None:
    """Print the composed, validated recipe (defaults included)."""
    cfg, composed = load_recipe(recipe, overrides)
    if not provenance:
        typer.echo(to_yaml(cfg), nl=False)
        if cfg.peft.method != "none":
            typer.echo(_peft_summary(cfg))
        return
    typer.echo("\n".join(_render_provenance(cfg.model_dump(mode="json"), composed.provenance)))


@app.command()
def models() -> None:
    """List the SupportedModel table."""
    from rich.console import Console
    from rich.table import Table

    from finetune.registry import SUPPORTED_MODELS

    table = Table("type", "task", "HF class", "FSDP wraps", "capabilities", "about")
    for row in SUPPORTED_MODELS.values():
        table.add_row(row.name, row.task, row.auto_class, row.decoder_layer, ", ".join(sorted(row.capabilities)),
                      row.description)
    Console().print(table)


def _describe(path: Path) -> str:
    """A recipe's description: its first header comment that is not the command line."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("# ").strip()
        if text and not text.startswith(("finetune ", "extends:")):
            return text
    return ""


@app.command()
def recipes() -> None:
    """List the shipped recipes and presets, one line each."""
    root = recipes_dir()
    for path in sorted(root.glob("*.yaml")) + sorted(root.glob("presets/*.yaml")):
        typer.echo(f"{path.relative_to(root)!s:<36} {_describe(path)}")


def main() -> None:
    """Console entry point: FinetuneError -> one line per problem on stderr, exit code 2."""
    from finetune.signals import Interrupted

    try:
        app()
    except Interrupted as exc:
        _echo_err(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        _echo_err("aborted (second interrupt): no checkpoint written for the current step")
        sys.exit(130)
    except FinetuneError as exc:
        if os.environ.get("FINETUNE_DEBUG"):
            raise
        for line in str(exc).splitlines():
            _echo_err(f"error: {line}")
        sys.exit(exc.exit_code)
