"""``finetune eval``: run :func:`finetune.loop.evaluate` alone on a run, a checkpoint or an exported model.

The target's recipe says which eval set, metrics and batch size to use (overrides may change them):
- a run dir (``runs/x``): its ``final/`` export;
- a checkpoint dir (``runs/x/checkpoints/step-000100``): the recipe's model with the checkpoint's weights;
- an exported model dir (``runs/x/final`` or a merged model): that model, with the recipe saved beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.config import RESOLVED_NAME, compose, validate
from finetune.errors import RunDirError


def _locate(target: Path) -> tuple[Path, Path | None, Path | None]:
    """(recipe, exported model dir or None, checkpoint dir or None) for ``target``."""
    if not target.is_dir():
        raise RunDirError(f"{target}: not a directory (give a run dir, a checkpoint dir or an exported model dir)")
    if (target / "final" / "config.json").is_file() and (target / RESOLVED_NAME).is_file():
        return target / RESOLVED_NAME, target / "final", None
    if (target / "config.json").is_file() and (target / RESOLVED_NAME).is_file():
        return target / RESOLVED_NAME, target, None
    if (target / "manifest.json").is_file() and (target / RESOLVED_NAME).is_file():
        return target / RESOLVED_NAME, None, target
    if (target / RESOLVED_NAME).is_file():
        raise RunDirError(f"{target}: the run has no final/ model yet; evaluate a checkpoint "
                          f"({target}/checkpoints/step-...) or finish the run with `finetune resume {target}`")
    raise RunDirError(f"{target}: no {RESOLVED_NAME} here; expected a run dir, a checkpoint dir or an exported model")


def evaluate_target(target: Path, overrides: list[str]) -> dict[str, Any]:
    """Metrics of ``target`` on its recipe's eval set (one process)."""
    recipe, exported, ckpt = _locate(target)
    cfg = validate(compose(recipe, overrides))
    if not cfg.data.eval:
        raise RunDirError(f"{recipe}: data.eval is not set; pass data.eval=path/to/eval.jsonl")

    from finetune import loop, registry
    from finetune.backends import Backend, make_accelerator
    from finetune.data import load_splits
    from finetune.modeling import build_model, build_tokenizer
    from finetune.precision import Precision
    from finetune.tasks import build_task
    from finetune.tracking import NullTracker

    row = registry.get_model(cfg.model.type)
    accelerator, _ = make_accelerator(cfg, row, Backend("single"))  # one process, whatever the run used
    source = str(exported) if exported else None
    tokenizer = build_tokenizer(cfg.model, row, source=source)
    data = load_splits(cfg.data, tokenizer, need_train=False)  # label names still come from the train file
    model = build_model(cfg.model, row, source=source, labels=data.labels)
    if ckpt is not None:
        _load_checkpoint_weights(model, ckpt)
    model = accelerator.prepare(model)
    task = build_task(cfg, row, tokenizer, data, accelerator.process_index, accelerator.num_processes)
    state = _checkpoint_state(ckpt)
    trainer = loop.Trainer(cfg, accelerator, model, None, None, Precision(cfg.train.mixed_precision,
                           accelerator.device.type), task, tokenizer, NullTracker(), state, Path(cfg.output_dir or "."),
                           state.step)
    metrics = loop.evaluate(trainer)
    metrics["target"] = str(exported or ckpt)
    return metrics


def _load_checkpoint_weights(model: Any, ckpt: Path) -> None:
    from safetensors.torch import load_file

    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise RunDirError(f"{ckpt}: no model.safetensors in this checkpoint")
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise RunDirError(f"{ckpt}: checkpoint does not fit the recipe's model "
                          f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")


def _checkpoint_state(ckpt: Path | None) -> Any:
    import json

    from finetune.state import TrainState

    state = TrainState()
    if ckpt is not None and (ckpt / "train_state.json").is_file():
        state.load_state_dict(json.loads((ckpt / "train_state.json").read_text()))
    return state
