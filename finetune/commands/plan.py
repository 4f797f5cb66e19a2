"""``finetune plan``'s report: the memory plan (finetune.runtime.plan, the estimator the worker also asks) as an
aligned plain-text table or one JSON object. The estimate lives with the code that trains; how it reads lives here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from finetune.runtime.plan import MemoryPlan, format_bytes


def render(plan: MemoryPlan) -> str:
    """The plan as an aligned plain-text table (no terminal needed)."""
    s, a = plan.sharding, plan.activations
    method = {"none": "full fine-tuning"}.get(plan.peft_method, plan.peft_method)
    pct = 100 * plan.trainable_params / max(1, plan.total_params)
    head = [
        f"memory plan for {plan.recipe}: {plan.model_type} ({plan.task}), {method}, {s.world} process(es), "
        f"backend {s.backend}",
        f"  sharding: {s.description}",
        f"  parameters: {plan.total_params:,} total, {plan.trainable_params:,} trainable ({pct:.2f}%)",
        f"  precision: weights {plan.model_dtype}, mixed_precision {plan.mixed_precision}, compute "
        f"{plan.compute_dtype}",
        f"  batch: micro {a.micro_batch_size} x {a.max_seq_len} tokens per rank; gradient checkpointing "
        f"{'on' if a.checkpointing else 'off'} ({a.checkpointing_reason})",
        "  dropout: " + ("on, as the model's config and peft.dropout set it (train.dropout: true)" if plan.dropout
                         else "off, every rate at 0 while training, LoRA's peft.dropout too (train.dropout: false)"),
        "",
    ]
    rows = [(i.label, format_bytes(i.per_rank_bytes), i.where, format_bytes(i.whole_bytes),
             f"/{i.shards}" if i.shards > 1 else "-", i.note) for i in plan.items]
    header = ("component", "per rank", "where", "whole model", "split", "what")
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(5)]

    def line(cells: Sequence[str]) -> str:
        return (f"{cells[0]:<{widths[0]}}  {cells[1]:>{widths[1]}}  {cells[2]:<{widths[2]}}  "
                f"{cells[3]:>{widths[3]}}  {cells[4]:>{widths[4]}}  {cells[5]}").rstrip()

    rule = "-" * (sum(widths) + 10)
    body = [line(header), rule, *(line(r) for r in rows), rule,
            line(("device total per rank", format_bytes(plan.device_total), "device", "", "", "")),
            line(("host total per rank", format_bytes(plan.host_total), "host", "", "", ""))]
    tail = ["", f"fit: {plan.fit.message}", *(f"note: {n}" for n in plan.notes),
            "note: activations are an estimate from the model config (formula: finetune/runtime/plan.py)"]
    return "\n".join(head + body + tail)


def to_json(plan: MemoryPlan) -> str:
    """The plan's figures as one JSON object (``finetune plan --json``)."""
    return json.dumps(plan.to_dict(), sort_keys=True)
