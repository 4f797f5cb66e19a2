"""The ``finetune`` command line.

This module imports nothing heavy: ``--help``, ``config``, ``models``, ``recipes`` and ``schema`` never load
torch; ``run --dry-run`` and ``plan`` load it for the memory plan's meta-device build only. The modules it imports
load torch inside the functions that need it (tests/unit/test_architecture.py). Every user mistake raises a
FinetuneError that :func:`main` prints as one line per problem with exit code 2 (``FINETUNE_DEBUG=1`` shows the
traceback). """

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from typer.exceptions import TyperException

from finetune import registry
from finetune.artifacts.portable import resume_targets
from finetune.commands import train
from finetune.commands.evaluate import evaluate_target
from finetune.commands.export import Exported
from finetune.commands.export import export as export_checkpoint
from finetune.commands.merge import merge as merge_adapter
from finetune.commands.plan import render, to_json
from finetune.commands.plot import plot_runs
from finetune.config import load_recipe, outputs, resources, to_yaml
from finetune.config.schema import recipe_file_schema
from finetune.errors import FinetuneError, RunDirError, run_main
from finetune.runtime import launch, prepare
from finetune.runtime.plan import build_plan
from finetune.storage import layout, rundir
from finetune.storage.choose import inventory
from finetune.storage.metrics import format_metrics
from finetune.storage.plot import SMOOTHING as PLOT_SMOOTHING
from finetune.storage.summary import read_summary
from finetune.storage.summary import render as summary_lines
from finetune.version import report

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # plain help (Click's layout): flags render as flags (`--overwrite`, not `--overwrite <bool>`), and help in a
    # pipe is not squashed into rich's 80-column boxes
    rich_markup_mode=None,
    help="Config-driven fine-tuning of Hugging Face models. Start with: finetune run quickstart",
)

Overrides = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. train.max_steps=50")]
RECIPE_HELP = "recipe YAML, or the name of a shipped recipe (see `finetune recipes`), e.g. quickstart"
TrustRemoteCode = Annotated[bool, typer.Option(
    "--trust-remote-code", help="run the model folder's own Python code, and import the model.plugin module a run's "
    "recipe names (never taken from a run's files)")]


@app.command()
def run(
    recipe: Annotated[str, typer.Argument(help=RECIPE_HELP)],
    overrides: Overrides = None,
    output_dir: Annotated[str | None, typer.Option("-o", "--output-dir", help="run directory")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing run directory")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the composed recipe and plan, then exit")] = False,
    accelerate_config: Annotated[str | None, typer.Option(help="name in accelerate_configs/ or a path")] = None,
    num_processes: Annotated[int | None, typer.Option(help="processes (data-parallel ranks)")] = None,
) -> None:
    """Train a recipe: compose, validate, read the data, create <output_dir> with recipe.resolved.yaml, then train."""
    train.run(recipe, overrides, output_dir=output_dir, overwrite=overwrite, dry_run=dry_run,
              accelerate_config=accelerate_config, num_processes=num_processes)


@app.command()
def preprocess(
    recipe: Annotated[str, typer.Argument(help=RECIPE_HELP)],
    overrides: Overrides = None,
    show: Annotated[int | None, typer.Option(
        "--show", min=1, help="then print the first N tokenized train rows (counted from 0, in the split's order, "
        "before shuffling) with the trained tokens marked: green on a terminal, [[between brackets]] in a pipe",
    )] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="with --show: one JSON object per row on stdout (split, row, text, trained [start, end] "
        "character spans, input_ids, labels); the report lines go to stderr")] = False,
) -> None:
    """Read and tokenize every data split of a recipe into the cache `finetune run` reads (and download a hub
    model), once, before any launch; run it on each machine whose disk holds its own cache."""
    if as_json and show is None:
        raise FinetuneError("--json prints the rows of --show: add --show N (e.g. --show 3 --json)")
    cfg, _ = train.recipe_with_flags(recipe, overrides)
    inputs = prepare.inputs(cfg, registry.recipe_row(cfg))
    for line in prepare.report(cfg, inputs.data):
        typer.echo(line, err=as_json)
    for line in inputs.data.warnings(cfg.data.max_seq_len):
        typer.echo(line, err=True)
    if show is not None:
        _show_rows(inputs, show, as_json=as_json)


def _show_rows(inputs: prepare.Inputs, count: int, *, as_json: bool) -> None:
    """``preprocess --show``: the first ``count`` rows of the tokenized train split, as stored, trained tokens
    marked (:mod:`finetune.data.show`)."""
    from finetune.data import show as shown  # imports numpy: not at CLI start-up

    split = inputs.data.train
    if split is None:
        raise FinetuneError("--show prints train rows, and this recipe has no tokenized data.train")
    note = shown.short_note(split.dataset, count)
    colour = sys.stdout.isatty()
    for text in shown.show(inputs.tokenizer, split.dataset, count, as_json=as_json, colour=colour):
        typer.echo(text, color=colour)
    if note is not None:
        typer.echo(note, err=True)


@app.command()
def plan(
    recipe: Annotated[str, typer.Argument(help=RECIPE_HELP)],
    overrides: Overrides = None,
    accelerate_config: Annotated[str | None, typer.Option(help="name in accelerate_configs/ or a path")] = None,
    num_processes: Annotated[int | None, typer.Option(help="processes (data-parallel ranks)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan's figures as one JSON object")] = False,
) -> None:
    """Print the per-rank memory plan (parameters, gradients, optimizer states, activations) before launching.
    model.path may be a folder or hub name with only config.json: no weights or tokenizer are read."""
    cfg, note = train.plan_recipe(recipe, overrides, accelerate_config=accelerate_config,
                                  num_processes=num_processes)
    memory = build_plan(cfg)
    if note is not None:
        memory = dataclasses.replace(memory, notes=(note, *memory.notes))
    typer.echo(to_json(memory) if as_json else render(memory))


@app.command()
def resume(
    run_dir: Annotated[Path, typer.Argument(help="the run directory (runs/<name>)")],
    overrides: Overrides = None,
    from_: Annotated[str | None, typer.Option("--from", help="checkpoint name, e.g. step-000100")] = None,
    allow_config_change: Annotated[bool, typer.Option(
        "--allow-config-change", help="continue although the recipe, data or tokenizer changed (logged)")] = False,
    accelerate_config: Annotated[str | None, typer.Option(help="name in accelerate_configs/ or a path")] = None,
    num_processes: Annotated[int | None, typer.Option(help="processes (data-parallel ranks)")] = None,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Continue a run exactly from its newest complete checkpoint (or --from), with its stored recipe. A finished
    run (its newest checkpoint at the last step, final/ exported from it) is left as it is: one line, exit 0."""
    train.resume(run_dir, overrides, from_=from_, allow_config_change=allow_config_change,
                 accelerate_config=accelerate_config, num_processes=num_processes,
                 trust_remote_code=trust_remote_code)


@app.command("ls")
def ls_(run_dir: Annotated[Path, typer.Argument(help="the run directory (runs/<name>)")]) -> None:
    """List a run's checkpoints: step, samples seen, resumable (and why not), size, time, layout (backend x world
    size, sharding) and where it can resume; then, for a finished run, the summary it ended with."""
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: not a run directory (no such folder)")
    if not (run_dir / rundir.RESOLVED).is_file():
        raise RunDirError(f"{run_dir}: not a run directory (no {rundir.RESOLVED})")
    _ls_checkpoints(run_dir)
    summary = read_summary(run_dir)  # a finished run: the summary it ended with, read back from its files
    if summary is not None:
        typer.echo("")
        for line in summary_lines(summary):
            typer.echo(line)


def _ls_checkpoints(run_dir: Path) -> None:
    """``finetune ls``'s checkpoint table."""

    complete, stale = rundir.checkpoint_dirs(run_dir), rundir.stale_checkpoint_dirs(run_dir)
    root = run_dir / rundir.CHECKPOINTS
    others = sorted(set(root.iterdir()) - set(complete) - set(stale)) if root.is_dir() else []
    if not complete and not stale:
        typer.echo(f"{run_dir}: no checkpoints" + (f" ({len(others)} other entries in {root})" if others else ""))
        return
    typer.echo(f"{'checkpoint':<18} {'step':>8} {'samples':>10}  {'resumable':<40} {'size':>9}  {'created':<19}  "
               "layout; resumes on")
    for path in stale:
        typer.echo(f"{path.name:<18} {'-':>8} {'-':>10}  {'no (incomplete write, ignored)':<40}")
    for info in inventory(run_dir):  # each manifest read once
        path = info.path
        status = "yes" if info.resumable else f"no ({info.reason})"
        where = "-" if info.manifest is None else \
            f"{layout.of(info.manifest).describe()}; {_resume_targets(info.manifest) if info.resumable else '-'}"
        typer.echo(f"{path.name:<18} {info.step if info.step is not None else '-':>8} "
                   f"{info.samples_seen if info.samples_seen is not None else '-':>10}  {status:<40} "
                   f"{info.size_bytes / 2**20:>7.1f}MB  {info.created or '-':<19}  {where}")
    for path in others:
        typer.echo(f"{path.name:<18} not a checkpoint (ignored)")


def _resume_targets(manifest: dict[str, Any]) -> str:
    """Where a checkpoint can resume (finetune.artifacts.portable, imported only here: ls stays light); ``?`` when its
    manifest is too damaged to say (ls lists anything without failing)."""

    try:
        return resume_targets(manifest)
    except (AttributeError, KeyError, TypeError, ValueError):
        return "?"


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="the run directory (runs/<name>), or one of its checkpoints")],
    output: Annotated[str, typer.Option("-o", "--output", help="the folder to write the Hugging Face model to")],
    from_: Annotated[str | None, typer.Option(
        "--from", help="checkpoint name, e.g. step-000100 (default: the newest resumable one)")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an export finetune wrote there")] = False,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Export any checkpoint (any backend, full or LoRA) as a Hugging Face folder, verified in a fresh process."""

    def report(done: Exported) -> None:  # said once published, whatever Ctrl+C comes meanwhile (commands/export.py)
        check = (f"verified in a fresh process: logits match the recorded probe, max |delta| {done.delta:.2e} <= "
                 f"{done.tolerance:g}" if done.recorded
                 else "loaded back in a fresh process; no recorded probe, not verified by logits")
        typer.echo(f"exported {done.checkpoint.name} (step {done.step}) of {run_dir} -> {done.out} ({done.kind}; "
                   f"{check})")

    export_checkpoint(run_dir, from_, outputs.given(output), overwrite, trust_remote_code, report=report)


@app.command("eval")
def eval_(
    target: Annotated[Path, typer.Argument(help="a run dir, a checkpoint dir, or an exported model dir")],
    as_json: Annotated[bool, typer.Option("--json", help="print the metrics as one JSON object")] = False,
    overrides: Overrides = None,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Evaluate a run's final model, a checkpoint, or an exported model on the recipe's eval set."""

    metrics = evaluate_target(target, overrides or [], trust_remote_code)
    if as_json:
        typer.echo(json.dumps(metrics, sort_keys=True))
    else:

        for line in format_metrics(metrics):  # each metric once: `eval_exact_match 198/200 = 0.9900`
            typer.echo(line)


@app.command()
def merge(
    target: Annotated[Path, typer.Argument(help="a LoRA run dir, its final/ adapter, or an adapter checkpoint")],
    output: Annotated[str, typer.Option("-o", "--output", help="where the merged model is written")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace what a previous merge wrote there")] = False,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Merge a LoRA adapter into its base model (safetensors), verifying the logits before keeping it."""

    merge_adapter(target, outputs.given(output), overwrite, trust_remote_code=trust_remote_code, log=typer.echo)


@app.command()
def generate(
    target: Annotated[Path, typer.Argument(
        help="a run dir, a checkpoint dir, or an exported model dir (final/, a `finetune merge` output)")],
    prompts: Annotated[Path, typer.Argument(
        help="JSON lines: {prompt: text}, {messages: [...]} without the final assistant turn, or the recipe's own "
             "prompt fields (alpaca: instruction, input); other keys are copied to the output")],
    output: Annotated[str, typer.Option("-o", "--output", help="the JSON lines file to write")],
    max_new_tokens: Annotated[int, typer.Option(help="most tokens generated per prompt")] = 128,
    temperature: Annotated[float, typer.Option(help="0: greedy; > 0: sample from softmax(logits / t)")] = 0.0,
    top_p: Annotated[float, typer.Option(help="sampling: keep the smallest set of tokens with this mass")] = 1.0,
    seed: Annotated[int, typer.Option(help="sampling: each prompt's generator is seeded by (seed, its line)")] = 0,
    batch_size: Annotated[int, typer.Option(help="prompts per forward pass (completions do not depend on it)")] = 8,
    num_processes: Annotated[int, typer.Option(help="processes, each generating every N-th prompt")] = 1,
    accelerate_config: Annotated[str | None, typer.Option(
        help="cpu or ddp (the default with --num-processes > 1), or a path")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing -o file")] = False,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Generate a completion for every prompt of a JSON lines file (greedy or sampled), in input order."""
    from finetune.commands.generate import Options, start  # lazy: imports numpy

    options = Options(max_new_tokens, temperature, top_p, seed, batch_size, overwrite, trust_remote_code)
    argv = start(target, prompts, outputs.given(output), options, num_processes, accelerate_config, log=typer.echo)
    if argv:  # several processes: accelerate launch runs finetune.commands.generate on every rank
        sys.stdout.flush()
        os.execvpe(argv[0], argv, launch.child_env())


@app.command()
def plot(
    runs: Annotated[list[Path], typer.Argument(help="run directories (runs/<name>); several are overlaid")],
    output: Annotated[str, typer.Option("-o", "--output", help="the PNG to write")] = "plot.png",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing -o file")] = False,
    smooth: Annotated[float, typer.Option(
        "--smooth", help="weight of the smoothed line over dense train curves (TensorBoard's debiased moving "
                         "average), 0 (off) up to, not including, 1")] = PLOT_SMOOTHING,
) -> None:
    """Plot each run's metrics against step into one PNG, one colour per run: what its task watches first (GRPO:
    rewards, completion length, KL), then loss, lr, grad norm and every eval metric."""

    panels = plot_runs(runs, outputs.given(output), overwrite=overwrite, smoothing=smooth)
    typer.echo(f"wrote {output}: {len(panels)} panels ({', '.join(p.key for p in panels)}) for "
               f"{len(runs)} run(s)")


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
    recipe: Annotated[str, typer.Argument(help=RECIPE_HELP)],
    overrides: Overrides = None,
    provenance: Annotated[bool, typer.Option("--provenance", help="say which file/override set each key")] = False,
) -> None:
    """Print the composed, validated recipe (defaults included)."""
    cfg, composed = load_recipe(resources.resolve_recipe(recipe), overrides)
    if not provenance:
        typer.echo(to_yaml(cfg), nl=False)
        if cfg.peft.method != "none":
            typer.echo(train.peft_summary(cfg, registry.recipe_row(cfg)))
        return
    typer.echo("\n".join(_render_provenance(cfg.model_dump(mode="json"), composed.provenance)))


@app.command()
def models() -> None:
    """List the SupportedModel table: the tested model families (model.type).

    The documentation's Model families page lists the same rows with their LoRA presets. A causal LM of a family
    not listed here trains with a row derived from its transformers class (untested; a warning says so)."""

    header = ("type", "task", "HF class", "FSDP wraps", "capabilities", "about")
    rows = [(row.name, row.task, row.auto_class, row.decoder_layer or "-", ", ".join(sorted(row.capabilities)) or "-",
             row.description) for row in registry.SUPPORTED_MODELS.values()]
    for line in plain_table(header, rows):
        typer.echo(line)


def plain_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns two spaces apart, each as wide as its widest cell: the same full text on a terminal
    and in a pipe (a rich table squashes itself to 80 columns when stdout is not a terminal)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return ["  ".join(f"{cell!s:<{width}}" for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in (header, *rows)]


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
    root = resources.recipes_dir()
    for path in sorted(root.glob("*.yaml")) + sorted(root.glob("presets/*.yaml")):
        typer.echo(f"{path.relative_to(root)!s:<36} {_describe(path)}")


@app.command()
def schema() -> None:
    """Print the JSON Schema of recipe files, for completion and checking in YAML editors
    (e.g. `finetune schema > recipe.schema.json`, then `# yaml-language-server: $schema=recipe.schema.json`)."""

    typer.echo(json.dumps(recipe_file_schema(), indent=2))


def _print_version(value: bool) -> None:
    """``finetune --version``: the versions a bug report needs, from package metadata, then exit."""
    if value:  # importlib.metadata only: no torch import (finetune/version.py)

        typer.echo("\n".join(report()))
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print finetune's version and its key libraries' (torch, transformers, ...), then exit")] = False) -> None:
    """Options of ``finetune`` itself, before any command (only ``--version``)."""


def _app() -> None:
    """The Typer app, with usage mistakes (an unknown flag or command, a missing argument, a value of the wrong type)
    as one FinetuneError line instead of Click's usage box."""

    try:
        os.getcwd()  # relative paths (runs/<name>, data, -o) all start here
    except FileNotFoundError:
        raise FinetuneError("the current folder no longer exists (it was deleted or moved away); cd to an existing "
                            "folder and run the command again") from None
    try:
        result = app(standalone_mode=False, prog_name="finetune")
    except TyperException as exc:
        context = getattr(exc, "ctx", None)
        command = getattr(context, "command_path", None) or "finetune"
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        if not message.strip():  # `finetune` alone: the help was printed
            sys.exit(getattr(exc, "exit_code", 2))
        raise FinetuneError(f"{command}: {message.strip()} (see `{command} --help`)") from None
    sys.exit(result if isinstance(result, int) else 0)


def main() -> None:
    """Console entry point: every failure is one line per problem on stderr and its exit code (finetune.errors)."""
    run_main(_app)
