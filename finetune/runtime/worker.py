"""The entry point on every rank: build everything from the resolved recipe, train, export, close.

``python -m finetune.runtime.worker runs/x/recipe.resolved.yaml`` (what ``accelerate launch`` runs), or
:func:`run_worker` in-process for a single process. The resolved recipe file is all it reads.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune import objectives, registry
from finetune.artifacts import checkpoint, portable
from finetune.artifacts.checkpoint import publishing
from finetune.artifacts.portable import PARAM_NAMES, ParamNames
from finetune.artifacts.probe import LogitProbe
from finetune.backends import (
    detect,
    extra_checkpoint_state,
    frozen_copy,
    make_accelerator,
    model_init,
    settle,
    size_deepspeed_buckets,
)
from finetune.config import RecipeConfig, load_resolved
from finetune.errors import ConfigError, RunDirError, run_main, unreadable
from finetune.runtime import context, materialize, plan, prepare, teacher
from finetune.runtime import peft as lora
from finetune.runtime.signals import Interrupted
from finetune.runtime.tracking import build_tracker
from finetune.storage import checkpoints, restored, rundir
from finetune.storage.metrics import truncate_metrics
from finetune.storage.plot import write_run_plot
from finetune.storage.state import TrainState, epoch_samples, total_steps
from finetune.storage.summary import read_summary, render

if TYPE_CHECKING:
    from finetune.backends import Backend
    from finetune.runtime import prepare
    from finetune.runtime.loop import Trainer


def fsdp_accumulation(cfg: RecipeConfig, backend: Backend) -> Backend:
    """FSDP with gradient accumulation on GPUs keeps whole gradients across a window's micro-steps only where
    finetune.runtime.plan says the recipe fits the smallest visible device with them (``unsharded_accumulation_fits``);
    everywhere else (the CPU, no accumulation, a plan that cannot be made) it reduce-scatters every micro-step,
    which never needs more memory. Asked here, above both, so that backends never imports the plan."""
    import torch  # heavy: imported only when a worker builds a run

    if not backend.asks_whether_unsharded_grads_fit or cfg.grad_accum == 1 or not torch.cuda.is_available():
        return backend

    try:
        fits = plan.unsharded_accumulation_fits(cfg, min(size for _, size in plan.visible_devices()))
    except Exception:  # the plan is an estimate for a speed-up; without one the memory-safe choice stands
        fits = False
    return backend.with_unsharded_grads(fits)


def _tracker(cfg: RecipeConfig, run_dir: Path, is_main: bool, start_step: int, max_steps: int, data: Any) -> Any:
    """The run's tracker, with the warnings and notes known before the model is built: a warm-up longer than the
    run, the mixture and what fitting max_seq_len did per source."""
    tracker = build_tracker(cfg, run_dir, is_main=is_main, start_step=start_step, max_steps=max_steps)
    if cfg.scheduler.warmup_steps > max_steps:  # a warning: train.log, and stderr unless a progress bar shows it
        tracker.log("info", {"level": "warning", "message": (
            f"warning: scheduler.warmup_steps={cfg.scheduler.warmup_steps} is longer than the run "
            f"({max_steps} steps): the lr never reaches optim.lr={cfg.optim.lr:g}")})
    for note in data.notes(cfg.data.max_seq_len):
        tracker.log("info", {"message": note})
    return tracker


def _build_model(cfg: RecipeConfig, row: Any, accelerator: Any, backend: Any, tokenizer: Any,
                 labels: list[str] | None, tracker: Any) -> Any:
    """The model this rank trains, before ``accelerator.prepare``: built (weights read once, see materialize),
    checked against the tokenizer, then frozen parts, gradient checkpointing, LoRA, dropout off and compile, in that
    order; each step that changes what trains says so in train.log."""
    from finetune.runtime import dropout  # lazy: imports torch
    from finetune.runtime.modeling import (
        build_base,
        check_fits,
        compile_model,
        enable_checkpointing,
        freeze,
        prequantized,
    )  # lazy: imports torch
    from finetune.runtime.precision import master_weights_warning  # lazy: imports torch

    quantization = lora.quantization_config(cfg.peft)
    with model_init(accelerator, backend, from_config=cfg.model.path is None):  # same weights on every rank/run
        model, load_note = materialize.build(
            accelerator, backend, cfg.model.path is not None, quantization is not None,
            lambda empty: build_base(cfg.model, row, cfg.train.seed, labels, quantization, empty=empty))
    if load_note:
        tracker.log("info", load_note)
    if dequantized := prequantized(cfg.model):  # GPT-OSS's MXFP4 experts, in model.dtype from here on
        tracker.log("info", {"message": dequantized})
    check_fits(model, tokenizer, cfg.data.max_seq_len)
    if cfg.model.freeze:
        frozen = freeze(model, row, cfg.model.freeze)
        tracker.log("info", {"message": f"model.freeze: {', '.join(cfg.model.freeze)} ({frozen} parameters) frozen"})
    if cfg.train.gradient_checkpointing:
        enable_checkpointing(model)
    if lora.enabled(cfg.peft):
        if cfg.train.gradient_checkpointing:
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need input grads
        model = lora.apply(model, cfg.peft, row)
        trainable, total = lora.parameter_counts(model)
        tracker.log("info", {"message": f"{cfg.peft.method}: {trainable} of {total} parameters trainable "
                                        f"({100 * trainable / total:.3f}%), targets "
                                        f"{', '.join(lora.target_modules(cfg.peft, row))}"})
        lora.register_adapter_checkpointing(accelerator)
    if not cfg.train.dropout:  # after LoRA: its dropout too
        modules, rates = dropout.disable(model)
        tracker.log("info", {"message": f"train.dropout: false: {modules} dropout module(s) and {rates} attention "
                                        "dropout rate(s) set to 0 for training (the exported config keeps them)"})
    if cfg.train.compile:  # in place, after LoRA, before prepare: see modeling.compile_model
        compile_model(model, row)
    if warning := master_weights_warning(model, backend):  # 16-bit weights updated without an fp32 copy
        tracker.log("info", {"level": "warning", "message": warning})
    return model


def _backend(cfg: RecipeConfig, row: registry.SupportedModel) -> Backend:
    """The backend this launch runs (the launcher's environment), after the checks that need no process group: the
    hardware LoRA asks for, loads made data-only, and an eval the backend cannot run."""
    lora.check_hardware(cfg.peft)
    backend = fsdp_accumulation(cfg, detect())  # the launcher's environment
    checkpoint.forbid_unpickling(backend)  # before anything is loaded: checkpoints and model folders are data only
    if row.image_token is not None and "exact_match" in cfg.eval.metrics and not backend.generates_unwrapped:
        raise ConfigError(f"eval.metrics: exact_match of {row.name} generates with transformers' generate, which "
                          f"{backend.name} cannot run; use launch.accelerate_config=fsdp2, or token_accuracy only")
    return backend


def _context(cfg: RecipeConfig, run_dir: Path, row: registry.SupportedModel, backend: Backend,
             inputs: prepare.Inputs) -> context.RunContext:
    """The run's fixed facts on this rank: the accelerator (the process group starts here), the run's id and its
    length; refused when the processes running are not the recipe's (grad_accum, so the global batch, depends on
    their number)."""
    accelerator, backend = make_accelerator(cfg, row, backend)
    accelerator.wait_for_everyone()  # under a user's launcher, rank 0 has created the run dir once it gets here
    run_id = rundir.run_id(run_dir)
    if accelerator.num_processes != cfg.launch.num_processes:
        raise ConfigError(f"launch.num_processes={cfg.launch.num_processes} but {accelerator.num_processes} "
                          f"process(es) are running; set launch.num_processes={accelerator.num_processes}")
    assert inputs.data.train is not None
    max_steps = total_steps(cfg, epoch_samples(cfg, inputs.data.train_size))  # a mixture's epoch is its draws
    return context.RunContext(cfg=cfg, run_dir=run_dir, run_id=run_id, row=row, labels=inputs.data.labels,
                              backend=backend, accelerator=accelerator, tokenizer=inputs.tokenizer,
                              max_steps=max_steps)


def training_line(ctx: context.RunContext, streamed: bool, train_size: int) -> str:
    """The line a run starts with in train.log: its length, its batch and how it is made up, the backend, and the
    training samples (``streamed``: data.streaming, whose size is unknown)."""
    cfg, acc = ctx.cfg, ctx.accelerator
    return (f"training {cfg.name}: {ctx.max_steps} steps, global batch {cfg.train.global_batch_size} (micro "
            f"{cfg.train.micro_batch_size} x accum {cfg.grad_accum} x {acc.num_processes} process(es)), backend "
            f"{ctx.backend.name} ({acc.distributed_type}), {'streamed' if streamed else train_size} train samples")


def build_trainer(cfg: RecipeConfig, run_dir: Path, start_step: int = 0, inputs: prepare.Inputs | None = None,
                  allow_plugin: bool = False) -> Trainer:
    """Build every object of a run on this rank: the run's context (accelerator, tokenizer, ...), data, model,
    optimizer, task, tracker. ``start_step``: the step a resumed run continues from (its progress display starts
    there). ``inputs``: the tokenizer and data this process already read (`finetune run` reads them before it
    creates the run folder). ``allow_plugin``: see :func:`run_worker` (a GRPO reward function is such code)."""
    from finetune.runtime import loop  # lazy: imports torch
    from finetune.runtime.meter import step_flops  # lazy: imports numpy
    from finetune.runtime.modeling import compile_failures  # lazy: imports torch
    from finetune.runtime.optim import build_optimizer, build_scheduler  # lazy: imports torch
    from finetune.runtime.precision import Precision  # lazy: imports torch
    from finetune.tasks import build_task, router  # lazy: imports numpy

    row = inputs.row if inputs is not None else registry.recipe_row(cfg)  # once per process; carried by the context
    backend = _backend(cfg, row)
    # before the process group exists, so that no rank waits in a collective while one tokenizes or downloads
    inputs = inputs or prepare.inputs(cfg, row)
    ctx = _context(cfg, run_dir, row, backend, inputs)
    accelerator, backend, tokenizer, data = ctx.accelerator, ctx.backend, ctx.tokenizer, inputs.data
    tracker = _tracker(cfg, run_dir, accelerator.is_main_process, start_step, ctx.max_steps, data)
    model = _build_model(cfg, row, accelerator, backend, tokenizer, data.labels, tracker)
    optimizer = build_optimizer(cfg.optim, model, accelerator.device.type)
    scheduler = build_scheduler(cfg.scheduler, optimizer, ctx.max_steps)
    param_names = ParamNames.of(model, optimizer)  # on the plain model: prepare wraps and may rename
    flops = step_flops(model, cfg.train.peak_tflops, accelerator.device)  # plain names, whole sizes (ZeRO-3 too)
    size_deepspeed_buckets(accelerator, model)  # DeepSpeed's 5e8-element reduce bucket, capped at the model
    model, optimizer = accelerator.prepare(model, optimizer)
    precision = Precision(cfg.train.mixed_precision, accelerator.device.type, backend)
    # accelerate saves model and optimizer; these are ours, saved as JSON + safetensors (never pickled). The
    # scheduler is not prepared: accelerate would step it once per process.
    objects = {"scheduler": scheduler, "scaler": precision.scaler, **extra_checkpoint_state(backend, model, optimizer),
               PARAM_NAMES: param_names,  # makes the checkpoint readable on any layout (finetune.artifacts.portable)
               **({"data_stream": data.stream} if data.stream is not None else {}),  # data.streaming: the cursor
               # the live model's logits on 2 x 16 probe tokens (made at the first checkpoint; task is bound below):
               # 2 x 16 x vocab fp32 per checkpoint, ~20 MB at a 150k vocabulary
               "probe": LogitProbe(model, accelerator.device, lambda: probe_batch(task, tokenizer, rows=2, length=16),
                                  precision)}
    task = build_task(cfg, row, tokenizer, data, accelerator.process_index, accelerator.num_processes,
                      lockstep=backend.shards_parameters, images=inputs.images, allow_plugin=allow_plugin,
                      frozen_copy=lambda prepared: frozen_copy(accelerator, prepared, backend),
                      teacher=_teacher_factory(cfg, row, backend))
    objects |= task.checkpoint_objects  # e.g. GRPO's generation batch inside a cycle
    tracker.log("info", {"message": training_line(ctx, bool(data.stream), data.train_size)})
    if line := router.note(model, task.adds_router_loss, cfg.task or row.task):  # a mixture-of-experts model
        tracker.log("info", {"message": line})
    # on the initial model (dpo's reference pass): now, before a resume loads a checkpoint
    with compile_failures(cfg.train.compile):
        task.prepare(lambda: model, accelerator, precision, lambda message: tracker.log("info", {"message": message}))
    state = TrainState(train_size=epoch_samples(cfg, data.train_size))
    return loop.Trainer(ctx, model, optimizer, scheduler, precision, task, tracker, state, objects=objects,
                        flops=flops)


def _teacher_factory(cfg: RecipeConfig, row: registry.SupportedModel, backend: Backend) -> Any:
    """The factory of a distillation's placed teacher (finetune.runtime.teacher.placed), None for other tasks."""
    record = objectives.objective(cfg.task)
    if record is None or not record.teacher:
        return None
    return lambda model, accelerator: teacher.placed(cfg, row, accelerator, backend, model)


def probe_batch(task: Any, tokenizer: Any, rows: int = 4, length: int = 32) -> dict[str, Any]:
    """A few fixed inputs (the first eval, else train, samples) on which exports record reference logits."""
    from finetune.data.batching import Collator  # lazy: imports torch

    split = task.data.eval or task.data.train
    assert split is not None
    key = "input_ids" if "input_ids" in split.dataset.column_names else "chosen_input_ids"  # preference pairs
    samples = [{"input_ids": split.dataset[i][key][:length]} for i in range(min(rows, len(split.dataset)))]
    batch = Collator(tokenizer.pad_token_id)(samples)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def clean_copy(trainer: Trainer) -> Callable[[], Any]:
    """A factory of a fresh, unwrapped copy of the trained model (base, and adapter for LoRA), built as this run
    built it; a backend that cannot save from its wrapped model saves from one (backends.export_module)."""
    from finetune.runtime.modeling import build_base  # lazy: imports torch

    cfg, row, labels = trainer.ctx.cfg, trainer.ctx.row, trainer.ctx.labels

    def build() -> Any:
        base = build_base(cfg.model, row, cfg.train.seed, labels)
        return lora.apply(base, cfg.peft, row) if lora.enabled(cfg.peft) else base

    return build


def resume_state(trainer: Trainer, ckpt: Path, allow_config_change: bool,
                 manifest: dict[str, Any] | None = None) -> None:
    """Load everything a checkpoint holds into the built trainer (all ranks), after checking the tokenizer and the
    layout; then (rank 0) drop the metrics rows logged after it. The front process verified its content hashes.

    Rows are dropped last, once the resume is sure to proceed: what the checkpoint holds was judged before anything
    loaded (finetune.storage.restored: the counters, scheduler, scaler and RNG states, and each object's own judge,
    e.g. GRPO's generation batch against the recipe and the restored step), and everything has loaded. A resume that
    fails leaves metrics.jsonl as it was. ``manifest``: the checkpoint's, read once by the caller (else here) and
    handed to every check and loader below."""
    from finetune.runtime.optim import group_settings, keep_recipe_settings  # lazy: imports torch

    ctx = trainer.ctx
    manifest = rundir.read_manifest(ckpt) if manifest is None else manifest
    if checkpoints.tokenizer_fingerprint(ctx.tokenizer) != manifest.get("tokenizer_sha256"):
        if not allow_config_change:
            raise RunDirError(f"resume refused: the tokenizer differs from the one {ckpt.name} was trained with; "
                              "pass --allow-config-change to continue anyway")
        trainer.tracker.log("info", {"message": "resume: tokenizer changed since the checkpoint (allowed)"})
    saved_by, saved_world = manifest.get("backend", "single"), manifest.get("world_size", 1)
    world = ctx.accelerator.num_processes
    native = ctx.backend.loads_natively(saved_by, saved_world, world)  # same layout, or single <-> ddp
    if not native and (why := portable.reshard_problem(manifest, ctx.cfg.optim.name)):
        raise RunDirError(f"resume refused: {ckpt.name} {ctx.backend.resume_problem(saved_by, saved_world, world)}"
                          f", and {why}: resume it that way, or `finetune export {ctx.run_dir} --from {ckpt.name} "
                          "-o DIR` and start a new run from DIR")
    settings = group_settings(trainer.optimizer)  # the recipe's: a checkpoint brings back the values it was saved with
    restored.check_objects(ckpt, trainer.objects, checkpoints.read_state)  # before anything loads
    with unreadable(lambda detail: f"{ckpt}: cannot be loaded ({detail}); the run dir is unchanged: resume from "
                    "another checkpoint with --from"):  # model, optimizer, scheduler, TrainState, scaler, RNG
        if not native:  # another layout: whole tensors, each rank keeping its part
            portable.resume_from(ctx.accelerator, ctx.backend, trainer.model, trainer.optimizer, ckpt,
                                 ctx.run_dir, manifest)
        checkpoint.load(ctx.accelerator, ckpt, trainer.state, trainer.objects, model_and_optimizer=native,
                        manifest=manifest)
    for line in keep_recipe_settings(trainer.optimizer, trainer.objects["scheduler"], settings):
        trainer.tracker.log("info", {"message": f"resume: {line} (the recipe's, not the checkpoint's)"})
    if not native:
        trainer.tracker.log("info", {"message": f"resume: {ckpt.name} resharded from {saved_by} on {saved_world} "
                                                f"process(es) to {ctx.backend.name} on {world}"})
    state = trainer.state
    # last: nothing that can refuse this resume comes after it
    dropped = truncate_metrics(ctx.run_dir, state.step) if ctx.accelerator.is_main_process else 0
    trainer.tracker.log("info", {"message": f"resumed from {ckpt.name}: step {state.step}, epoch {state.epoch}, "
                                            f"{state.samples_seen} samples seen; dropped {dropped} metrics rows "
                                            "logged after it"})


def resumed_manifest(checkpoint_dir: str | Path | None) -> dict[str, Any] | None:
    """The manifest of the checkpoint a resume continues from, read once for the whole resume (the progress
    display's step, the checks, the loaders); None for a new run, or when it cannot be read (loading the checkpoint
    then reports what is wrong with it)."""
    if checkpoint_dir is None:
        return None
    try:
        return rundir.read_manifest(Path(checkpoint_dir))
    except rundir.ManifestError:
        return None


def resumed_step(manifest: dict[str, Any] | None) -> int:
    """The step a resume continues from (its checkpoint's manifest), for the progress display; 0 for a new run, or
    when the manifest cannot tell."""
    step = manifest.get("step") if manifest is not None else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0


def run_worker(recipe: str | Path | RecipeConfig, resume_from: str | Path | None = None,
               allow_config_change: bool = False, allow_plugin: bool = False, *,
               inputs: prepare.Inputs | None = None) -> None:
    """Train a run on this rank, then export it. ``recipe``: the resolved recipe file (what a relaunched worker
    reads), or the validated recipe itself when the CLI already runs on every rank under a launcher (the other
    ranks must not race rank 0 writing the file). ``allow_plugin``: the file's ``model.plugin`` may be imported
    (what the launching command allowed: ``finetune run`` always, ``finetune resume`` with --trust-remote-code).

    ``inputs``: see :func:`build_trainer`.

    Raises :class:`finetune.runtime.signals.Interrupted` after saving a checkpoint when a SIGINT/SIGTERM asked to stop.
    """
    from finetune.runtime import loop  # lazy: imports torch
    from finetune.runtime.modeling import compile_failures  # lazy: imports torch

    started = time.monotonic()
    cfg = recipe if isinstance(recipe, RecipeConfig) else load_resolved(recipe, allow_plugin)
    manifest = resumed_manifest(resume_from)  # read once: every step of the resume below is handed it
    trainer = build_trainer(cfg, Path(cfg.output_dir or "."), start_step=resumed_step(manifest), inputs=inputs,
                            allow_plugin=allow_plugin)
    ctx = trainer.ctx
    try:
        if resume_from is not None:
            main = ctx.accelerator.is_main_process
            try:
                resume_state(trainer, Path(resume_from), allow_config_change, manifest)
            except BaseException:
                if main:
                    rundir.adopt_resumed(None, ctx.run_dir)
                raise
            if main:
                rundir.adopt_resumed(cfg, ctx.run_dir)
        with trainer.stop.installed(), compile_failures(cfg.train.compile):  # torch compiles at first use
            loop.train(trainer)
        if cfg.checkpoint.save_final:
            with compile_failures(cfg.train.compile):  # a LoRA export runs the (compiled) model on its probe
                out = _export(trainer)
            trainer.tracker.log("info", {"message": f"exported {out}"})
        if cfg.data.eval:  # after the export: a final eval that fails (e.g. out of memory) loses nothing
            with compile_failures(cfg.train.compile):
                trainer.tracker.log("eval", loop.checked_evaluate(trainer))
        if ctx.accelerator.is_main_process:  # <run>/plots.png; a failure is one warning line, never a failed run

            write_run_plot(ctx.run_dir, log=lambda row: trainer.tracker.log("info", row))
            report_end(trainer, time.monotonic() - started)
        settle(ctx.accelerator)  # every rank, before end_training tears the process group down
    except Interrupted as exc:  # in train.log; the console gets it once, from the exit (finetune.errors)
        trainer.tracker.log("info", {"message": str(exc), "console": False})
        raise
    finally:
        trainer.tracker.close()
        ctx.accelerator.end_training()


def _export(trainer: Trainer) -> Path:
    """The trained model's ``final/`` export (every rank: :func:`finetune.artifacts.final.export_final`), with the
    reference logits on a few eval samples and the clean copy a backend may need to save from."""
    from finetune.artifacts import final  # lazy: imports torch

    return final.export_final(trainer.ctx, trainer.model, trainer.state.step,
                              probe=probe_batch(trainer.task, trainer.ctx.tokenizer), rebuild=clean_copy(trainer),
                              precision=trainer.precision)


def report_end(trainer: Trainer, wall_s: float) -> None:
    """Rank 0, once the run has finished: the end row in metrics.jsonl, then the run's summary read back from what
    it wrote (:mod:`finetune.storage.summary`, which ``finetune ls`` shows again), on the console and in train.log."""

    state = trainer.state
    trainer.tracker.log("end", {"step": state.step, "samples": state.samples_seen, "tokens": state.tokens_seen,
                                "train_s": round(state.elapsed_s, 3), "wall_s": round(wall_s, 3)})
    summary = read_summary(trainer.ctx.run_dir, trainer.ctx.row)
    for line in render(summary) if summary else []:
        trainer.tracker.log("info", {"message": line})


def execute(recipe: str | Path | RecipeConfig, resume_from: str | Path | None = None,
            allow_config_change: bool = False, allow_plugin: bool = False) -> None:
    """:func:`run_worker` with the CLI's messages and exit codes (finetune.errors.run_main); the process exits once
    its last checkpoint is published (finetune.artifacts.checkpoint.publishing)."""

    def run() -> None:
        with publishing():
            run_worker(recipe, resume_from, allow_config_change, allow_plugin)

    run_main(run, say_stops=os.environ.get("RANK", "0") == "0")  # every rank stops; rank 0 says so, once


def main(argv: list[str] | None = None) -> None:
    """``python -m finetune.runtime.worker RESOLVED [--resume CKPT] [--allow-config-change] [--allow-plugin]`` on every
    rank."""

    parser = argparse.ArgumentParser(prog="python -m finetune.runtime.worker")
    parser.add_argument("resolved", help="runs/<name>/recipe.resolved.yaml")
    parser.add_argument("--resume", default=None, help="checkpoint directory to continue from")
    parser.add_argument("--allow-config-change", action="store_true")
    parser.add_argument("--allow-plugin", action="store_true", help="import the recipe's model.plugin")
    args = parser.parse_args(argv)
    execute(args.resolved, args.resume, args.allow_config_change, args.allow_plugin)


if __name__ == "__main__":
    from finetune.runtime.launch import die_with_launcher, isolate_sys_path

    isolate_sys_path()
    die_with_launcher()
    main()
