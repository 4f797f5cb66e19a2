"""``finetune eval``: :func:`finetune.runtime.loop.evaluate_model` alone on a run, a checkpoint or an exported model.

Before anything is loaded the target is verified against its manifest (sha256 of every file); loading is data only
(safetensors, no pickles), and the model folder's own code runs only with ``--trust-remote-code`` on this command
line, never because the run's recipe says so. The target's recipe says which eval set, metrics and batch size to
use (overrides may change them):
- a run dir (``runs/x``): its ``final/`` export;
- a checkpoint dir (``runs/x/checkpoints/step-000100``) of any backend (single, DDP, FSDP, ZeRO; full or LoRA): the
  checkpoint is exported, as ``finetune export`` exports it, to a scratch folder outside the run dir (removed
  afterwards), loaded back from there and checked against the logits the checkpoint recorded; that model is
  evaluated;
- an exported dir: a full model (``final/``, ``finetune export`` or ``finetune merge`` output), or a PEFT adapter on
  the recipe's base.
"""

from __future__ import annotations

import contextlib
import errno
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from finetune.artifacts.checkpoint import forbid_unpickling
from finetune.artifacts.probe import ProbeMismatch, forward_precision
from finetune.artifacts.target import (  # (opened here, and by generate)
    Target,
    load_model,
    load_tokenizer,
    open_target,
    portable_overrides,
)
from finetune.artifacts.writer import export_manifest, write_checkpoint
from finetune.backends import backend_named, make_accelerator
from finetune.config import RecipeConfig
from finetune.errors import FinetuneError, RunDirError, _io_cause
from finetune.storage import rundir

__all__ = ["Target", "evaluate_target", "load_model", "load_tokenizer", "open_target", "portable_overrides",
           "reload_checkpoint", "scratch_folder"]


def evaluate_target(target: Path, overrides: list[str], trust_remote_code: bool = False) -> dict[str, Any]:
    """Metrics of ``target`` on its recipe's eval set (one process). A checkpoint is evaluated through its export
    (:func:`reload_checkpoint`) in a scratch folder outside the run dir, removed afterwards. stdout is the
    caller's alone (``finetune eval --json`` prints one JSON object there): whatever prints while the target is
    evaluated (a reward function, a plugin, a library) goes to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        return _evaluate_target(target, overrides, trust_remote_code)


def _evaluate_target(target: Path, overrides: list[str], trust_remote_code: bool) -> dict[str, Any]:
    forbid_unpickling()
    where, cfg = open_target(target, overrides, trust_remote_code)
    if not cfg.data.eval:
        raise RunDirError(f"{where.recipe}: data.eval is not set; pass data.eval=path/to/eval.jsonl")
    if where.checkpoint is None:
        return _evaluate(where, cfg, None, trust_remote_code)
    with scratch_folder("finetune-eval-") as scratch:
        return _evaluate(where, cfg, scratch, trust_remote_code)


@contextlib.contextmanager
def scratch_folder(prefix: str, parent: Path | None = None) -> Iterator[Path]:
    """A new empty ``<prefix>...tmp`` folder (in ``parent``, else the system's temporary folder: TMPDIR), deleted
    with everything in it when the block ends, however it ends."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, suffix=rundir.TMP, dir=parent))
    try:
        yield folder
    except Exception as exc:  # a full TMPDIR: one line that says where (a library's error does not), exit 2
        full = _io_cause(exc)
        if full is None or full.errno not in (errno.ENOSPC, errno.EDQUOT) or isinstance(exc, FinetuneError):
            raise
        raise RunDirError(f"no room for the scratch export in {folder.parent} (the temporary folder: TMPDIR): "
                          f"{full.strerror}; free space there or point TMPDIR at a folder with room") from exc
    finally:
        rundir.remove_scratch(folder)


def reload_checkpoint(cfg: RecipeConfig, where: Target, scratch: Path, log: Callable[[str], None],
                      trust_remote_code: bool = False) -> Any:
    """The model ``finetune eval`` evaluates for a checkpoint: the checkpoint exported to ``scratch`` and verified
    exactly as ``finetune export`` does (the one writer, :func:`finetune.artifacts.writer.write_checkpoint`: a fresh
    process reproduces the logits the checkpoint recorded, under the same tolerance rule; ProbeMismatch, exit 1,
    when it does not), then loaded from there (a full model, or an adapter for LoRA runs)."""
    assert where.checkpoint is not None
    log(f"loading {where.checkpoint} ({where.backend} checkpoint) and exporting it to a scratch folder ...")

    def mismatch(delta: float, tol: float, rule: str, recorded: bool) -> FinetuneError:
        against = f"the ones recorded at step {where.step}" if recorded else "the model it was read into"
        return ProbeMismatch(f"{where.checkpoint}: its export reloaded gives logits up to {delta:.2e} away from "
                             f"{against} (tolerance {tol:g}: {rule}); not evaluated: this checkpoint was not read "
                             "correctly, please report it")

    folder = scratch / "export"
    written = write_checkpoint(cfg, where, folder, trust_remote_code=trust_remote_code, log=lambda line: None,
                               mismatch=mismatch, manifest=export_manifest(None, where.step))
    if written.expected.recorded:
        log(f"verified: the export reproduces the recorded logits (max |delta| {written.delta:.2e}, tolerance "
            f"{written.tolerance:g})")
    else:
        log(f"note: {where.checkpoint.name} recorded no probe logits (written before finetune recorded them); its "
            "export was loaded back in a fresh process but not verified by the training run's logits")
    exported = Target(where.recipe, **{"adapter" if written.kind == "adapter" else "full_model": folder},
                      checkpoint=where.checkpoint, step=where.step, backend=where.backend, manifest=where.manifest,
                      row=where.row, labels=where.labels)
    return load_model(cfg, exported)


def _evaluate(where: Target, cfg: RecipeConfig, scratch: Path | None,
              trust_remote_code: bool = False) -> dict[str, Any]:
    """Evaluate ``where`` (``scratch``: a checkpoint target's export folder) with the loop's own evaluation."""
    from finetune.data import PromptOptions, load_splits  # lazy: imports numpy
    from finetune.runtime import loop  # lazy: imports torch
    from finetune.runtime.modeling import build_base, image_inputs  # lazy: imports torch
    from finetune.tasks import build_task  # lazy: imports numpy

    row = where.row
    assert row is not None
    accelerator, _ = make_accelerator(cfg, row, backend_named("single"))  # one process, whatever the run used
    export = where.full_model or where.adapter
    tokenizer = load_tokenizer(cfg, where)
    images = image_inputs(tokenizer, row)  # a vision-language row's image processor (else None)
    data = load_splits(cfg.data, tokenizer, need_train=False, images=images, labels=where.labels,  # not from train
                       prompt=PromptOptions.of(cfg))
    if scratch is not None:
        loaded = reload_checkpoint(cfg, where, scratch, lambda line: print(line, file=sys.stderr), trust_remote_code)
    else:
        loaded = load_model(cfg, where)
    model = accelerator.prepare(loaded)
    precision = forward_precision(cfg.train.mixed_precision, accelerator.device)  # every forward: as training ran
    task = build_task(cfg, row, tokenizer, data, accelerator.process_index, accelerator.num_processes, images=images,
                      allow_plugin=trust_remote_code)  # e.g. a GRPO reward function named by the run's recipe

    def initial() -> Any:  # what dpo scores its reference with: the base with the adapter off, or model.path
        return model if hasattr(model, "disable_adapter") else accelerator.prepare(
            build_base(cfg.model, row, cfg.train.seed, data.labels))

    task.prepare(initial, accelerator, precision, lambda message: print(message, file=sys.stderr), splits=("eval",))
    metrics = loop.evaluate_model(model, task, precision, accelerator, cfg.eval.metrics, where.step or 0)
    if where.checkpoint is None:
        metrics.pop("step")  # an export has no step of its own
    metrics["target"] = str(export or where.checkpoint)
    return metrics
