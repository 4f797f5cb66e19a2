"""THE shared training loop: no model-specific code, every task and backend goes through here.

Semantics (docs/architecture.md, "Semantics"): a *step* is one optimizer update, a *micro-step* one forward/backward.
The training loss of a step is the sum of per-target losses over its whole accumulation window and all ranks,
divided by the number of targets in that window (label tokens for causal LM, samples for classification: the task
counts them); that division happens in one place (:func:`train_step`), and the logged loss is that number. Eval
accuracy is ``sum(correct) / sum(total)`` over all ranks and all eval samples. Host syncs are marked ``# sync``.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune import hooks
from finetune.artifacts import checkpoint
from finetune.backends import Backend, backend_named
from finetune.config import RecipeConfig
from finetune.errors import CollapseError, EvalError, FinetuneError, NonFiniteError
from finetune.registry import SupportedModel
from finetune.runtime import collapse, meter
from finetune.runtime.precision import Precision
from finetune.runtime.signals import Interrupted, StopRequest
from finetune.runtime.tracking import Throughput, Tracker
from finetune.storage import checkpoints
from finetune.storage.state import TrainState
from finetune.tasks import Task

# An fp16 step skipped for overflow still advances the schedule (a step is a step); torch warns about exactly that.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before", category=UserWarning)


@dataclass
class Trainer:
    """Everything the loop needs, built by the worker."""

    cfg: RecipeConfig
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    precision: Precision
    task: Task
    tokenizer: Any
    tracker: Tracker
    state: TrainState
    run_dir: Path
    max_steps: int
    backend: Backend = field(default_factory=lambda: backend_named("single"))
    stop: StopRequest = field(default_factory=StopRequest)
    run_id: str = ""
    objects: dict[str, Any] = field(default_factory=dict)  # checkpointed state besides model/optimizer/TrainState
    flops: meter.StepFlops | None = None  # the model's FLOPs and the device's peak, for flops_per_token and mfu
    row: SupportedModel | None = None  # the recipe's row (registry.recipe_row), resolved once by the worker


@dataclass
class StepStats:
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    skipped: bool
    stop: bool = False
    nonfinite: bool = False
    inputs: int = 0  # input tokens of the window on all ranks (padding left out)
    squares: int = 0  # the sum of their samples' squared lengths (the attention FLOPs)
    extra: dict[str, float] = field(default_factory=dict)  # the task's metrics of the step (Task.step_metrics)


def _due(step: int, every: int | None) -> bool:
    return bool(every) and step % every == 0  # type: ignore[operator]


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train(t: Trainer) -> TrainState:
    """Run optimizer steps until ``max_steps``, with periodic logging, checkpoints and evaluation (each step's
    checkpoint first; the last step's eval is the worker's, after the export)."""
    cfg, state = t.cfg, t.state
    batches = iter(t.task.build_dataloader("train", start_sample=state.samples_seen))
    if cfg.eval.at_start and state.step == 0 and cfg.data.eval:
        t.tracker.log("eval", evaluate(t))
    started = time.perf_counter() - state.elapsed_s
    throughput = Throughput(state.tokens_seen, state.elapsed_s,  # from where this process starts (resume: its ckpt)
                            processes=t.accelerator.num_processes, flops=t.flops)
    t.model.train()
    nonfinite_streak, watch = 0, _collapse_watch(t)
    while state.step < t.max_steps:
        stats = train_step(t, [next(batches) for _ in range(cfg.grad_accum)])
        state.advance(micro_steps=cfg.grad_accum, samples=cfg.train.global_batch_size, tokens=stats.tokens)
        state.elapsed_s = time.perf_counter() - started
        throughput.add(stats.inputs, stats.squares)
        nonfinite_streak = nonfinite_streak + 1 if stats.nonfinite else 0
        collapsed = watch.observe(stats.loss, stats.grad_norm, stats.skipped)
        last = state.step == t.max_steps
        if _due(state.step, cfg.logging.every_steps) or last or stats.nonfinite or collapsed:
            t.tracker.log("train", _train_row(t, stats, throughput))
        if stats.nonfinite:
            _nonfinite(t, stats, nonfinite_streak)  # raises NonFiniteError after max_nonfinite_steps in a row
        if collapsed:
            _collapsed(t, watch, stats, ending=last or stats.stop)  # raises CollapseError: see there
        if _save_due(t, last, collapsed) or stats.stop:  # before this step's eval: an eval that fails loses nothing
            path = checkpoint.save(t.accelerator, cfg, state, t.objects, t.tokenizer, t.run_dir, t.backend.name,
                                   t.run_id, t.task.data.labels, t.row)
            t.tracker.log("info", {"message": f"saved checkpoint {path.name}"})
        if cfg.data.eval and _due(state.step, cfg.eval.every_steps) and not last:  # the last: after the export
            t.tracker.log("eval", checked_evaluate(t))
        hooks.fire("after_step", trainer=t)
        if stats.stop and not last:
            raise Interrupted(f"stopped by signal after step {state.step}; checkpoint {path.name} saved; continue with "
                              f"`finetune resume {t.run_dir}`", t.stop.exit_code)
    return state


def train_step(t: Trainer, window: list[dict[str, Any]]) -> StepStats:
    """One optimizer step over this rank's micro-batches of the accumulation window; skipped (no update) when the
    window's loss or gradient norm is not finite."""
    acc, device = t.accelerator, t.accelerator.device
    local_tokens = torch.tensor(float(sum(map(t.task.count_targets, window))), device=device)  # counted on host
    tail = t.cfg.data.pack_to_multiple_of is not None
    inputs, squares = map(sum, zip(*(meter.input_lengths(b, padded_tail=tail) for b in window), strict=True))
    window = [_to_device(b, device) for b in window]
    total_tokens = acc.reduce(local_tokens, reduction="sum")  # sync: the window's label tokens on all ranks
    # The one division: sum(loss over window and ranks) / total_tokens. Data-parallel backends average gradients
    # over ranks and accelerate (or the DeepSpeed engine) divides each micro-step's loss by the accumulation
    # steps, so both factors are multiplied back here.
    denominator = total_tokens.clamp(min=1.0) / (acc.num_processes * acc.gradient_accumulation_steps)
    loss_sum_local = torch.zeros((), device=device, dtype=torch.float64)
    for batch in window:
        with acc.accumulate(t.model):  # no gradient sync (and no DeepSpeed step) until the window's last micro-step
            with t.precision.autocast():
                loss_sum = t.task.train_output(t.model, batch)
            acc.backward(t.precision.scaler.scale(loss_sum / denominator))
        loss_sum_local += loss_sum.detach().double()
    assert acc.sync_gradients, "a window is exactly gradient_accumulation_steps micro-steps"
    t.precision.scaler.unscale_(t.optimizer)
    max_norm = t.cfg.train.max_grad_norm or math.inf
    grad_norm = float(acc.clip_grad_norm_(t.model.parameters(), max_norm))  # sync
    # sync: the window's loss over all ranks, whether any rank was asked to stop (all stop after this step), and
    # its input tokens and squared sample lengths (for tok/s and the FLOPs), in this one reduce
    host = torch.tensor([float(t.stop.requested), inputs, squares], device=device, dtype=torch.float64)
    summed = acc.reduce(torch.cat([loss_sum_local.reshape(1), host]), reduction="sum")
    loss = float(summed[0] / total_tokens.clamp(min=1.0).double())
    finite = math.isfinite(loss) and math.isfinite(grad_norm)  # the same on every rank: both are all-reduced
    stepped = t.precision.step(t.optimizer, apply=finite)  # (DeepSpeed's engine skips such a step itself)
    lr = t.scheduler.get_last_lr()[0]  # the lr this step used
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    # an fp16 overflow that the dynamic loss scale explains is the scaler's business, not a divergence
    nonfinite = not finite and not (math.isfinite(loss) and t.precision.absorbs_overflow())
    extra = t.task.step_metrics(lambda sums: acc.reduce(sums, reduction="sum"))  # sync, only for a task with any
    return StepStats(loss=loss, lr=lr, grad_norm=grad_norm, tokens=int(total_tokens), skipped=not stepped,
                     stop=bool(summed[1] > 0), nonfinite=nonfinite, inputs=int(summed[2]), squares=int(summed[3]),
                     extra=extra)


def _nonfinite(t: Trainer, stats: StepStats, streak: int) -> None:
    """Log a skipped non-finite step; stop the run (NonFiniteError, nothing exported) after too many in a row."""
    limit, step = t.cfg.train.max_nonfinite_steps, t.state.step
    t.tracker.log("info", {"message": f"step {step}: loss {stats.loss} / grad_norm {stats.grad_norm} is not finite: "
                                      f"update skipped ({streak} in a row; the run stops at "
                                      f"train.max_nonfinite_steps={limit})"})
    if streak >= limit:
        raise NonFiniteError(
            f"training diverged: {streak} steps in a row up to step {step} had a non-finite loss or gradient norm "
            f"(loss {stats.loss}, grad_norm {stats.grad_norm}); nothing was exported. Try a lower optim.lr (now "
            f"{t.cfg.optim.lr:g}), train.mixed_precision=bf16, or gradient clipping (train.max_grad_norm); a "
            f"checkpoint continues with `finetune resume {t.run_dir} optim.lr=... --allow-config-change`")


def _collapse_watch(t: Trainer) -> collapse.Watch:
    """A run's collapse watch, with the signature of its task and model (:func:`collapse.signature`)."""
    row_task = t.row.task if t.row is not None else None
    return collapse.Watch(collapse.signature(t.cfg.task, row_task, t.accelerator.unwrap_model(t.model)))


def _collapsed(t: Trainer, watch: collapse.Watch, stats: StepStats, ending: bool) -> None:
    """Log a step that looks collapsed; stop the run (CollapseError, nothing exported) after collapse.STEPS in a
    row, or at once when the run ends at this step (``ending``: the last step, whose weights would be the export, or
    a stop signal, whose checkpoint would be resumed). No checkpoint is saved during a collapse (:func:`_save_due`),
    so the newest one, which the line names, predates it."""
    t.tracker.log("info", {"message": watch.step_line(t.state.step, stats.loss)})
    if watch.must_stop(ending):
        newest = checkpoints.latest_resumable(t.run_dir)
        kept = newest.path.name if newest is not None else None
        line = watch.stop_line(t.state.step, stats.loss, t.cfg.optim.lr, t.run_dir, kept)
        t.tracker.log("info", {"message": line, "console": False})  # train.log says why the run ended
        raise CollapseError(line)


def _save_due(t: Trainer, last: bool, collapsed: bool) -> bool:
    """Whether this step saves a checkpoint: every ``checkpoint.every_steps`` and at the last step, but never a
    model that looks collapsed: its rotation (``checkpoint.keep_last``) would delete the good checkpoints before it."""
    every = t.cfg.checkpoint.every_steps
    due = _due(t.state.step, every) or (last and bool(every))
    if due and collapsed:
        t.tracker.log("info", {"message": f"step {t.state.step}: checkpoint not saved: the model looks collapsed"})
    return due and not collapsed


def _train_row(t: Trainer, stats: StepStats, throughput: Throughput) -> dict[str, Any]:
    """The logged train row; the rates since the previous row (``tokens_per_s``, ``mfu``, ...) and this device's
    memory peaks are computed here once, for every sink."""
    row: dict[str, Any] = {
        "step": t.state.step, "loss": stats.loss, "lr": stats.lr,
        "grad_norm": stats.grad_norm, "tokens": t.state.tokens_seen, "elapsed_s": round(t.state.elapsed_s, 3),
        **throughput.rates(t.state.tokens_seen, t.state.elapsed_s), **meter.memory_peaks(t.accelerator.device),
        **stats.extra,
    }
    if t.precision.loss_scale is not None:
        row["loss_scale"] = t.precision.loss_scale
    if t.precision.loss_scale is not None or stats.skipped:
        row["skipped"] = stats.skipped
    if stats.nonfinite:
        row["nonfinite"] = True
    return row


def checked_evaluate(t: Trainer) -> dict[str, Any]:
    """:func:`evaluate` during a run: a failure (out of memory, a library error) becomes one EvalError line naming
    the step, the cause, what is kept and the fix. Eval changes no weight, optimizer state or data cursor, and it runs
    after the step's checkpoint (and the last step's after the export), so the run stays resumable and ``final/``
    stays intact."""
    try:
        return evaluate(t)
    except (FinetuneError, Interrupted, KeyboardInterrupt):
        raise
    except Exception as exc:
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        newest = checkpoints.latest_resumable(t.run_dir)
        kept = f"{newest.path.name} is the newest resumable checkpoint" if newest else "no checkpoint was saved yet"
        if t.state.step >= t.max_steps:  # the final eval: the export (if any) is already written
            then = f"`finetune eval {t.run_dir} eval.batch_size=N`"
        else:
            then = f"`finetune resume {t.run_dir} eval.batch_size=N --allow-config-change`"
        raise EvalError(f"eval at step {t.state.step} failed ({type(exc).__name__}: {detail}); {kept} and nothing "
                        f"else was changed; lower eval.batch_size (now {t.cfg.eval.batch_size}) or fix the cause, "
                        f"then {then}") from exc


def evaluate(t: Trainer) -> dict[str, Any]:
    """:func:`evaluate_model` of the run's model at its step; the best eval loss is kept in the train state."""
    row = evaluate_model(t.model, t.task, t.precision, t.accelerator, t.cfg.eval.metrics, t.state.step)
    if "eval_loss" in row:
        t.state.best_eval_loss = min(t.state.best_eval_loss, row["eval_loss"])
    return row


@torch.no_grad()
def evaluate_model(model: Any, task: Any, precision: Any, accelerator: Any, metrics: list[str],
                   step: int) -> dict[str, Any]:
    """Loss, perplexity and metrics over the whole eval set, summed over ranks (nothing dropped or repeated): what a
    run logs at ``step`` and what ``finetune eval`` reports, from the same code. Needs no optimizer, schedule or run
    folder: the model, the task that reads the eval split, the precision every forward runs in, and the
    accelerator that reduces over the ranks."""
    metrics = list(metrics)
    means = list(task.eval_means)  # named means (sum, count), after the metrics' counts
    device = accelerator.device
    sums = torch.zeros(3 + 2 * len(metrics) + 2 * len(means), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for batch in task.build_dataloader("eval"):
        with precision.autocast():
            counts = task.eval_output(model, _to_device(batch, device))
        if batch.get("filler"):
            continue  # ran only so that sharded ranks stay in lockstep; counts nothing
        parts = [counts.loss_sum, counts.num_tokens, torch.tensor(task.count_samples(batch), device=device)]
        for name in metrics:
            parts += [counts.correct[name], counts.total[name]]
        for name in means:
            parts += list(counts.means[name])
        sums += torch.stack([p.detach().double() for p in parts])
    sums = accelerator.reduce(sums, reduction="sum").tolist()  # sync: one all-reduce for the whole eval
    model.train(was_training)
    row: dict[str, Any] = {"step": step}
    if task.eval_loss:  # GRPO's eval generates: it has no loss
        row["eval_loss"] = loss = sums[0] / max(sums[1], 1.0)
        if task.perplexity:  # a per-pair loss (dpo, reward) has no perplexity
            row["eval_ppl"] = math.exp(min(loss, 50.0))
    row["eval_samples"] = int(sums[2])
    for i, name in enumerate(metrics):
        correct, total = int(sums[3 + 2 * i]), int(sums[4 + 2 * i])
        row[f"eval_{name}"] = correct / total if total else 0.0
        row[f"eval_{name}_correct"], row[f"eval_{name}_total"] = correct, total
    if metrics:
        row["eval_correct"], row["eval_total"] = row[f"eval_{metrics[0]}_correct"], row[f"eval_{metrics[0]}_total"]
    for i, name in enumerate(means):
        total, count = sums[3 + 2 * len(metrics) + 2 * i], sums[4 + 2 * len(metrics) + 2 * i]
        row[f"eval_{name}"] = total / count if count else 0.0
    return row
