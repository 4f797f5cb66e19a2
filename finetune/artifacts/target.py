"""Locate and open what a run left behind (a run, a checkpoint, a full export or an adapter export), and build its
model.

Opening verifies the folder against its manifest first (sha256 of every file; nothing else of it is read before),
then reads from that one manifest what building the model needs: the step and layout of a checkpoint, the model row
(model type and task) and the classification label names. They are carried on the :class:`Target`, so no command
re-resolves the row or re-reads the training data to learn the labels. A folder written before finetune recorded
them falls back to its recipe (the row; ``data.labels``), and says so in one line when the labels are unknown.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune import registry
from finetune.artifacts.portable import apply_model_state, read_full_state
from finetune.config import RecipeConfig, remote_code_from_flag, validate
from finetune.config.compose import apply_overrides, compose_stored
from finetune.errors import ConfigError, FinetuneError, RunDirError, unreadable
from finetune.quiet import library_warnings_off
from finetune.registry import CUSTOM_WEIGHTS, SupportedModel
from finetune.runtime import peft as lora
from finetune.storage import layout, rundir
from finetune.storage.checkpoints import verify
from finetune.storage.record import labels_of, row_of


@dataclass
class Target:
    """Where a model to evaluate, export, merge or generate with lives, and what its manifest says about it."""

    recipe: Path
    full_model: Path | None = None  # config.json + weights
    adapter: Path | None = None  # adapter_config.json + adapter weights
    checkpoint: Path | None = None
    step: int | None = None  # the checkpoint's step, from its verified manifest
    backend: str | None = None  # the backend that wrote the checkpoint, from its verified manifest
    manifest: dict[str, Any] = field(default_factory=dict)  # the verified manifest (read once)
    row: SupportedModel | None = None  # the model row it was trained as (model type + task)
    labels: list[str] | None = None  # the classification label names (None: not a classification row)


def owning_run(folder: Path) -> Path | None:
    """The run directory ``folder`` lies in (or is) as its path is written: the nearest folder at or above it that
    holds a run marker, with no link below it resolved (a link is what :func:`check_own` refuses); None outside
    every run."""
    path = folder.absolute()
    return next((p for p in (path, *path.parents) if os.path.lexists(p / rundir.MARKER)), None)


def check_own(run: Path, folder: Path) -> None:
    """Refuse, in one line, ``folder`` inside ``run`` unless every name from the run down to it is a real folder:
    a symbolic link there (``final/``, ``checkpoints/``, ``step-N``) points at what this run did not write, and a
    command would report another run's model as this run's."""
    here = run
    for part in folder.absolute().relative_to(run).parts:
        here = here / part
        mode = os.lstat(here).st_mode
        if not stat.S_ISDIR(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a folder"
            raise RunDirError(f"{here}: {what}, not a folder of the run {run}; finetune reads a run's model and "
                              "checkpoints only from what that run wrote there: move it away (nothing was read)")


def locate(target: Path) -> Target:
    """Classify ``target`` (a run, a checkpoint, a full export or an adapter export). Inside a run, only the
    run's own folders are read: a link in the place of ``final/`` or of a checkpoint is refused (:func:`check_own`)."""
    if not target.is_dir():
        raise RunDirError(f"{target}: not a directory (give a run dir, a checkpoint dir or an exported model dir)")
    run = owning_run(target)
    if run is not None:
        check_own(run, target)
    if (target / rundir.RESOLVED).is_file() and os.path.lexists(target / rundir.FINAL):
        if run is not None:
            check_own(run, target / rundir.FINAL)
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


def open_target(target: Path, overrides: list[str], trust_remote_code: bool, manifest: dict[str, Any] | None = None,
                run_id: str | None = None) -> tuple[Target, RecipeConfig]:
    """Locate and verify ``target`` and compose its recipe, with ``trust_remote_code`` from the command line only;
    the row and labels come from its manifest. Verification comes first: nothing of the target is read beyond its
    manifest until its hashes match. ``manifest``: the folder's manifest when the caller has read it already
    (:mod:`finetune.storage.choose`); it is verified all the same. ``run_id``: it must belong to that run."""
    where = locate(target)
    folder = where.recipe.parent
    run = owning_run(folder)
    if run is not None and run_id is None:  # a folder of a run is that run's: its manifest says so
        data = rundir.read_manifest(folder) if manifest is None else manifest
        run_id, manifest = rundir.run_id(run), data
        if data.get("run_id") != run_id:
            raise RunDirError(f"{folder}: its manifest is of another run (run id {data.get('run_id')}) than the run "
                              f"{run} it lies in ({run_id}): it was copied there; finetune reads a run's model and "
                              "checkpoints only from what that run wrote: move it away")
    where.manifest = verify(folder, run_id, manifest)
    cfg = recipe_of(where.recipe, overrides, trust_remote_code)
    return described(where, cfg), cfg


def described(where: Target, cfg: RecipeConfig) -> Target:
    """``where`` with what its (verified) manifest says filled in: the step and layout of a checkpoint, the row and
    the labels."""
    manifest = where.manifest
    if where.checkpoint is not None:
        where.step = manifest.get("step") if isinstance(manifest.get("step"), int) else None
        where.backend = layout.of(manifest).backend
    where.row = row_of(manifest, cfg)
    where.labels = labels_of(manifest, cfg, where.row, where.recipe.parent)
    return where


def recipe_of(recipe: Path, overrides: list[str], trust_remote_code: bool) -> RecipeConfig:
    """A run's (verified) recipe file, validated for THIS machine: ``trust_remote_code`` from the command line only
    (it also decides whether the recipe's ``model.plugin`` may be imported), plus :func:`portable_overrides` (each
    change it makes is noted on stderr). Its training files need not exist: nothing that opens a run reads them."""
    composed = compose_stored(recipe, remote_code_from_flag(overrides, trust_remote_code))
    machine, notes = portable_overrides(composed.data)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return validate(apply_overrides(composed, machine), allow_plugin=trust_remote_code, train_files=False)


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
        import torch  # lazy: heavy

        from finetune.runtime.modeling import flash_attn_installed  # imports torch

        missing = ("the flash_attn package is not installed" if not flash_attn_installed()
                   else "no CUDA device is available" if not torch.cuda.is_available() else None)
        if missing:
            overrides.append("model.attn_implementation=null")
            notes.append(f"model.attn_implementation: the run used flash_attention_2, but {missing} here; using the "
                         "model's default attention instead (same function; rounding may differ slightly)")
    return overrides, notes


def load_model(cfg: RecipeConfig, where: Target, labels: list[str] | None = None, quantized: bool = True) -> Any:
    """The model of ``where``, built as its row with its labels (``labels``: others, e.g. for a folder opened
    without a manifest). A QLoRA adapter sits on the 4-bit base it was trained with, unless ``quantized`` is False
    (merge: the full-precision base). A checkpoint of any backend is read by :func:`apply_checkpoint`."""
    from finetune.runtime.modeling import build_base, build_model, loading  # imports torch

    row = where.row or registry.recipe_row(cfg)
    labels = labels if labels is not None else where.labels
    if where.full_model is not None:  # a custom row's export is loaded into its factory's model (build_model)
        return build_model(cfg.model, row, source=str(where.full_model), labels=labels)
    if row.factory is not None:
        raise ConfigError(f"{where.checkpoint or where.adapter}: {row.name} is a custom model (factory {row.factory}); "
                          "`finetune export` and `finetune eval` of a checkpoint need a Hugging Face model: evaluate "
                          "the run's final/ (finetune eval RUN), or resume the run to its end first")
    quantization = lora.quantization_config(cfg.peft) if quantized else None
    base = build_base(cfg.model, row, cfg.train.seed, labels, quantization)
    if where.adapter is not None:
        from peft import PeftModel  # lazy: heavy

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
    :mod:`finetune.artifacts.portable` (the model alone needs no scratch folder)."""
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
    from finetune.runtime.modeling import build_tokenizer  # imports torch

    export = where.full_model or where.adapter
    return build_tokenizer(cfg.model, where.row or registry.recipe_row(cfg), source=str(export) if export else None)
