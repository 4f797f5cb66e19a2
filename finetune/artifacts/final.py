"""A run's ``final/`` export, written at the end of training through the one writer (:mod:`finetune.artifacts.writer`).

Every rank takes part (the full state dict and the LoRA reference forward are collectives under sharded backends);
rank 0 writes. The weights are checked finite on rank 0 and its verdict is shared, so every rank raises together.
``final/`` is not reloaded in a fresh process here: its source is the live model itself (nothing was converted from a
checkpoint's layout), and each later command that opens it verifies what it uses (``finetune merge`` reproduces the
``merge_check.safetensors`` recorded here; ``finetune export``/``eval`` of a checkpoint reload their own folder).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from finetune.artifacts import writer
from finetune.backends import export_module, full_state_dict, layout
from finetune.config import to_yaml
from finetune.errors import NonFiniteError
from finetune.runtime.context import RunContext
from finetune.runtime.modeling import save_custom_weights, save_tokenizer
from finetune.storage import rundir
from finetune.storage.record import record


def export_final(ctx: RunContext, model: Any, step: int, probe: dict[str, Any] | None = None,
                 rebuild: Callable[[], Any] | None = None, precision: Any = None) -> Path:
    """Write ``<run_dir>/final`` in Hugging Face format: a full model (safetensors, config with the label mapping)
    or, for LoRA runs, a PEFT adapter plus ``merge_check.safetensors`` (the live model's logits on ``probe``, which
    ``finetune merge`` must reproduce), or for a custom (factory) row its state dict alone
    (:func:`finetune.runtime.modeling.save_custom_weights`); always the tokenizer, the resolved recipe and a manifest
    (with the row, the classification labels and the layout, :mod:`finetune.storage.record`). ``ctx``: the run
    (folder, recipe, row, labels, backend, tokenizer); ``model``: the trained model at ``step``.

    It is written to ``final.tmp`` and replaces a previous ``final/`` only when complete; weights that are not all
    finite are never exported (NonFiniteError, the previous ``final/`` stays). ``rebuild`` makes a fresh, unwrapped
    copy of the model (base and adapter) for a backend that must save from one (see
    :func:`finetune.backends.export_module`). ``precision``: the run's
    :class:`finetune.runtime.precision.Precision`, whose
    autocast the reference forward runs under, as training ran (None: no autocast, fp32 training)."""
    accelerator, cfg, run_dir, backend, row = ctx.accelerator, ctx.cfg, ctx.run_dir, ctx.backend, ctx.row
    out = run_dir / rundir.FINAL
    state_dict = full_state_dict(accelerator, model, backend)  # collective under sharded backends
    flag = torch.tensor(0.0 if not accelerator.is_main_process or writer.all_finite(state_dict) else 1.0,
                        device=accelerator.device)
    if float(accelerator.reduce(flag, reduction="sum")) > 0:  # sync: every rank learns rank 0's verdict
        raise NonFiniteError(f"the trained weights hold inf or nan; {out} was not written (a previous export stays); "
                             "lower optim.lr, use train.mixed_precision=bf16 or set train.max_grad_norm")
    reference = None
    if cfg.peft.method != "none" and probe is not None:
        was_training = model.training
        model.eval()
        autocast = precision.autocast() if precision is not None else contextlib.nullcontext()
        with torch.no_grad(), autocast:  # every rank: a forward pass is a collective under sharded backends
            inputs = {k: v.to(accelerator.device) for k, v in probe.items()}
            reference = {**probe, "logits": model(**inputs).logits.float().cpu()}
        model.train(was_training)
    if accelerator.is_main_process:
        def save(tmp: Path) -> None:
            from safetensors.torch import save_file  # lazy: heavy

            if row.factory is not None:  # a custom model: its state dict (no config.json)
                save_custom_weights(state_dict or {}, tmp)
            else:
                saver = export_module(accelerator, model, backend, state_dict, rebuild)
                saver.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            save_tokenizer(ctx.tokenizer, tmp)
            (tmp / rundir.RESOLVED).write_text(to_yaml(cfg))
            if reference is not None:
                save_file({k: v.contiguous() for k, v in reference.items()}, str(tmp / rundir.MERGE_CHECK))

        head = {**writer.export_manifest(ctx.run_id, step), **record(cfg, row, ctx.labels),
                "layout": layout(backend.name, accelerator.num_processes)}
        writer.write(out, save, head, tmp=run_dir / rundir.FINAL_TMP, old=run_dir / rundir.FINAL_OLD)
    accelerator.wait_for_everyone()
    return out
