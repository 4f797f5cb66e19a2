"""``finetune eval``: run :func:`finetune.loop.evaluate` alone on a run, a checkpoint or an exported model.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import layout, rundir
from finetune.config import RecipeConfig, compose, remote_code_from_flag, validate
from finetune.config.compose import apply_overrides
from finetune.errors import ConfigError, FinetuneError, RunDirError, _io_cause, unreadable
from finetune.registry import CUSTOM_WEIGHTS


@dataclass
class Target:
    """Where a model to evaluate (or merge) lives."""

    recipe: Path
    full_model: Path | None = None  # config.json + weights
    adapter: Path | None = None  # adapter_config.json + adapter weights
    checkpoint: Path | None = None
    step: int | None = None  # the checkpoint's step, from its verified manifest
    backend: str | None = None  # the backend that wrote the checkpoint, from its verified manifest


def locate(target: Path) -> Target:
    """Classify ``target`` (a run, a checkpoint, a full export or an adapter export)."""
    if not target.is_dir():
        raise RunDirError(f"{target}: not a directory (give a run dir, a checkpoint dir or an exported model dir)")
    if (target / rundir.FINAL).is_dir() and (target / rundir.RESOLVED).is_file():
        target = target / rundir.FINAL
    if (target / rundir.RESOLVED).is_file():
        recipe = target / rundir.RESOLVED
        if (target / rundir.TRAIN_STATE).is_file():
            return Target(recipe, checkpoint=target)
        if (target / "config.json").is_file():
            return Target(recipe, full_model=target)
        if (target / "adapter_config.json").is_file():
            return Target(recipe, adapter=target)
        if (target / CUSTOM_WEIGHTS).is_file():  # a custom (factory) model's export: its state dict, no config.json
            return Target(recipe, full_model=target)
        raise RunDirError(f"{target}: the run has no final/ model yet; evaluate a checkpoint "
                          f"({target}/checkpoints/step-...) or finish it with `finetune resume {target}`")
    raise RunDirError(f"{target}: no {rundir.RESOLVED} here; expected a run dir, a checkpoint dir or an exported "
                      "model")


def open_target(target: Path, overrides: list[str], trust_remote_code: bool) -> tuple[Target, RecipeConfig]:
    """Locate and verify ``target`` and compose its recipe, with ``trust_remote_code`` from the command line only.
    Verification comes first: nothing of the target is read beyond its manifest until its hashes match."""
    from finetune.checkpoint import verify

    where = locate(target)
    manifest = verify(where.recipe.parent, None)
    if where.checkpoint is not None:
        where.step = manifest.get("step") if isinstance(manifest.get("step"), int) else None
        where.backend = layout.of(manifest).backend
    return where, recipe_of(where.recipe, overrides, trust_remote_code)


def recipe_of(recipe: Path, overrides: list[str], trust_remote_code: bool) -> RecipeConfig:
    """A run's (verified) recipe file, validated for THIS machine: ``trust_remote_code`` from the command line only
    (it also decides whether the recipe's ``model.plugin`` may be imported), plus :func:`portable_overrides` (each
    change it makes is noted on stderr)."""
    composed = compose(recipe, remote_code_from_flag(overrides, trust_remote_code))
    machine, notes = portable_overrides(composed.data)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return validate(apply_overrides(composed, machine), allow_plugin=trust_remote_code)


def portable_overrides(recipe: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The overrides that let a run's recipe load on THIS machine for eval and merge, and a note for each change a
    user should know about.

    A recipe records how the run was trained: its launcher (an accelerate config that may have been a file on
    another machine, several processes) and an attention kernel that may not exist here (flash_attention_2 needs
    the flash_attn package and a CUDA device). Eval and merge always run one process, and every attention
    implementation computes the same function, so neither may stop them: the launch section becomes one process
    with the shipped ``cpu`` config (never used by them, only validated), and flash_attention_2 falls back to the
    model's default attention (noted: the numbers can differ from the run's by kernel rounding)."""
    overrides = ["launch.accelerate_config=cpu", "launch.num_processes=1"]
    notes: list[str] = []
    model = recipe.get("model") if isinstance(recipe.get("model"), dict) else {}
    if model.get("attn_implementation") == "flash_attention_2":
        import torch

        from finetune.modeling import flash_attn_installed

        missing = ("the flash_attn package is not installed" if not flash_attn_installed()
                   else "no CUDA device is available" if not torch.cuda.is_available() else None)
        if missing:
            overrides.append("model.attn_implementation=null")
            notes.append(f"model.attn_implementation: the run used flash_attention_2, but {missing} here; using the "
                         "model's default attention instead (same function; rounding may differ slightly)")
    return overrides, notes


def load_model(cfg: RecipeConfig, where: Target, labels: list[str] | None, quantized: bool = True) -> Any:
    """The model of ``where``. A QLoRA adapter sits on the 4-bit base it was trained with, unless ``quantized`` is
    False (merge: the full-precision base). A checkpoint of any backend is read by :func:`apply_checkpoint`."""
    from finetune import peft as lora
    from finetune import registry
    from finetune.modeling import build_base, build_model, loading

    row = registry.get_model(cfg.model.type, cfg.task)
    if where.full_model is not None:  # a custom row's export is loaded into its factory's model (build_model)
        return build_model(cfg.model, row, source=str(where.full_model), labels=labels)
    if row.factory is not None:
        raise ConfigError(f"{where.checkpoint or where.adapter}: {row.name} is a custom model (factory {row.factory}); "
                          "`finetune export` and `finetune eval` of a checkpoint need a Hugging Face model: evaluate "
                          "the run's final/ (finetune eval RUN), or resume the run to its end first")
    quantization = lora.quantization_config(cfg.peft) if quantized else None
    base = build_base(cfg.model, row, cfg.train.seed, labels, quantization)
    if where.adapter is not None:
        from peft import PeftModel

        from finetune.quiet import library_warnings_off

        with loading("adapter", str(where.adapter), key="eval"), library_warnings_off():  # peft asks a deprecated alias
            return PeftModel.from_pretrained(base, str(where.adapter))
    assert where.checkpoint is not None
    if lora.enabled(cfg.peft):
        base = lora.apply(base, cfg.peft, row)
    apply_checkpoint(base, where.checkpoint)
    return base


def apply_checkpoint(model: Any, ckpt: Path) -> None:
    """Load a verified checkpoint's model weights, in whatever layout its backend wrote them (single/DDP
    safetensors, FSDP's DCP shards, DeepSpeed ZeRO partitions; full or adapter-only), into ``model`` (built from
    the checkpoint's recipe, with the adapter applied for LoRA runs), in this one process through
    :mod:`finetune.portable` (the model alone needs no scratch folder)."""
    from finetune.portable import apply_model_state, read_full_state

    with unreadable(lambda detail: f"{ckpt}: the model weights cannot be read ({detail}); the checkpoint is damaged "
                    "or of another finetune version: use another checkpoint"):
        state = read_full_state(ckpt, optimizer=False).model
    try:
        apply_model_state(model, state)
    except FinetuneError:
        raise
    except (RuntimeError, KeyError, ValueError) as exc:  # torch's load_state_dict: missing/unexpected keys, shapes
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise RunDirError(f"{ckpt}: the checkpoint's weights do not fit the model its recipe builds ({detail})") \
            from exc


def load_tokenizer(cfg: RecipeConfig, where: Target) -> Any:
    """The tokenizer saved with an export (a full model or an adapter), else the one the recipe's model names."""
    from finetune import registry
    from finetune.modeling import build_tokenizer

    export = where.full_model or where.adapter
    row = registry.get_model(cfg.model.type, cfg.task)
    return build_tokenizer(cfg.model, row, source=str(export) if export else None)


def evaluate_target(target: Path, overrides: list[str], trust_remote_code: bool = False) -> dict[str, Any]:
    """Metrics of ``target`` on its recipe's eval set (one process). A checkpoint is evaluated through its export
    (:func:`reload_checkpoint`) in a scratch folder outside the run dir, removed afterwards."""
    from finetune.checkpoint import forbid_unpickling

    forbid_unpickling()
    where, cfg = open_target(target, overrides, trust_remote_code)
    if not cfg.data.eval:
        raise RunDirError(f"{where.recipe}: data.eval is not set; pass data.eval=path/to/eval.jsonl")
    if where.checkpoint is None:
        return _evaluate(where, cfg, None)
    with scratch_folder("finetune-eval-") as scratch:
        return _evaluate(where, cfg, scratch)


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


def reload_checkpoint(cfg: RecipeConfig, where: Target, labels: list[str] | None, tokenizer: Any, scratch: Path,
                      log: Callable[[str], None]) -> Any:
    """The model ``finetune eval`` evaluates for a checkpoint: the checkpoint's weights (any backend's layout) in
    the recipe's model, saved to ``scratch`` as an export (a full model, or an adapter for LoRA runs; with
    ``tokenizer``, which a reward model's config is built from), loaded back from there, and checked against the
    logits the checkpoint recorded, computed in the training precision (ProbeMismatch, exit 1, when they differ; a
    checkpoint written before probes existed is evaluated with a note)."""
    from finetune import peft as lora
    from finetune import probe
    from finetune.modeling import save_tokenizer

    assert where.checkpoint is not None
    recorded = probe.read(where.checkpoint)  # a damaged record is refused before the weights are read
    log(f"loading {where.checkpoint} ({where.backend} checkpoint) and exporting it to a scratch folder ...")
    model = load_model(cfg, where, labels)
    folder = scratch / "export"
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    del model
    exported = Target(where.recipe, **{"adapter" if lora.enabled(cfg.peft) else "full_model": folder},
                      checkpoint=where.checkpoint, step=where.step, backend=where.backend)
    model = load_model(cfg, exported, labels)
    if recorded is None:
        log(f"note: {where.checkpoint.name} recorded no probe logits (written before finetune recorded them); its "
            "export was not verified by logits")
        return model
    from finetune.merge import tolerance_rule

    quantized, mixed = cfg.peft.method == "qlora", cfg.train.mixed_precision
    tol = probe.tolerance(cfg.model.dtype, mixed, where.backend or "single", quantized, probe.scale_of(recorded.logits))
    delta = probe.max_delta(probe.logits_of(model, recorded.inputs, mixed), recorded.logits)
    if not delta <= tol:
        raise probe.ProbeMismatch(f"{where.checkpoint}: its export reloaded gives logits up to {delta:.2e} away from "
                                  f"the ones recorded at step {where.step} (tolerance {tol:g}: "
                                  f"{tolerance_rule(cfg.model.dtype, quantized, mixed)}); not evaluated: this "
                                  "checkpoint was not read correctly, please report it")
    log(f"verified: the export reproduces the recorded logits (max |delta| {delta:.2e}, tolerance {tol:g})")
    return model


def _evaluate(where: Target, cfg: RecipeConfig, scratch: Path | None) -> dict[str, Any]:
    """Evaluate ``where`` (``scratch``: a checkpoint target's export folder) with the loop's own evaluate()."""
    from finetune import loop, registry
    from finetune.backends import Backend, make_accelerator
    from finetune.data import load_splits
    from finetune.modeling import build_base, image_inputs
    from finetune.probe import forward_precision
    from finetune.state import TrainState
    from finetune.tasks import build_task
    from finetune.tracking import NullTracker

    row = registry.get_model(cfg.model.type, cfg.task)
    accelerator, _ = make_accelerator(cfg, row, Backend("single"))  # one process, whatever the run used
    export = where.full_model or where.adapter
    tokenizer = load_tokenizer(cfg, where)
    images = image_inputs(tokenizer, row)  # a vision-language row's image processor (else None)
    data = load_splits(cfg.data, tokenizer, need_train=False, images=images)  # labels still come from train
    if scratch is not None:
        loaded = reload_checkpoint(cfg, where, data.labels, tokenizer, scratch,
                                   lambda line: print(line, file=sys.stderr))
    else:
        loaded = load_model(cfg, where, data.labels)
    model = accelerator.prepare(loaded)
    precision = forward_precision(cfg.train.mixed_precision, accelerator.device)  # every forward: as training ran
    task = build_task(cfg, row, tokenizer, data, accelerator.process_index, accelerator.num_processes, images=images)

    def initial() -> Any:  # what dpo scores its reference with: the base with the adapter off, or model.path
        return model if hasattr(model, "disable_adapter") else accelerator.prepare(
            build_base(cfg.model, row, cfg.train.seed, data.labels))

    task.prepare(initial, accelerator, precision, lambda message: print(message, file=sys.stderr), splits=("eval",))
    state = TrainState()
    state.step = where.step or 0
    trainer = loop.Trainer(cfg, accelerator, model, None, None, precision, task, tokenizer, NullTracker(), state,
                           Path(cfg.output_dir or "."), state.step)
    metrics = loop.evaluate(trainer)
    if where.checkpoint is None:
        metrics.pop("step")  # an export has no step of its own
    metrics["target"] = str(export or where.checkpoint)
    return metrics
