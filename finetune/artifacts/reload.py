"""``python -m finetune.artifacts.reload EXPORT --inputs IN --output OUT``: an export's logits, computed in a fresh
process.

The one writer (:func:`finetune.artifacts.writer.write`: ``finetune export``, ``eval`` of a checkpoint, ``merge``)
runs this in a new Python process so that its check sees the folder exactly as a user will: nothing of the writing
process (its model, its imports, its state) carries over. The folder is loaded the way ``finetune eval`` loads an
export (:func:`finetune.artifacts.target.load_model`): ``from_pretrained`` of a full model, or the recipe's base
plus ``PeftModel.from_pretrained`` of an adapter; data only (safetensors), the folder's own code only with
``--trust-remote-code``. The logits on the inputs of ``IN`` (safetensors: input_ids, attention_mask) are computed
under ``--mixed-precision`` (the recipe's ``train.mixed_precision``, which the writing process passes in: the
forward runs in the training precision, :func:`finetune.artifacts.probe.forward_precision`) and written to ``OUT``
(safetensors: logits, fp32). Failures are one ``error:`` line and an exit code (run_main).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from finetune.artifacts import probe
from finetune.artifacts.checkpoint import forbid_unpickling
from finetune.artifacts.target import load_model, locate, recipe_of
from finetune.errors import run_main


def reload_logits(folder: Path, inputs: Path, output: Path, labels: list[str] | None, trust_remote_code: bool,
                  mixed_precision: str) -> None:
    """Load the export in ``folder`` and write its logits on ``inputs``, computed under ``mixed_precision``
    autocast, to ``output``."""
    from safetensors.torch import load_file, save_file  # lazy: heavy

    forbid_unpickling()
    where = locate(folder)
    cfg = recipe_of(where.recipe, [], trust_remote_code)
    model = load_model(cfg, where, labels)
    logits = probe.logits_of(model, load_file(str(inputs)), mixed_precision)
    save_file({"logits": logits.contiguous()}, str(output))


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run :func:`reload_logits` with finetune's messages and exit codes."""

    parser = argparse.ArgumentParser(prog="python -m finetune.artifacts.reload")
    parser.add_argument("folder", type=Path, help="an export: config.json + weights, or a PEFT adapter")
    parser.add_argument("--inputs", type=Path, required=True, help="safetensors with input_ids and attention_mask")
    parser.add_argument("--output", type=Path, required=True, help="where the logits are written (safetensors)")
    parser.add_argument("--labels", default=None, help="classification label names (JSON list) the base is built with")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--mixed-precision", required=True, choices=("no", "bf16", "fp16"),
                        help="the autocast the forward runs under: the recipe's train.mixed_precision")
    args = parser.parse_args(argv)
    labels = json.loads(args.labels) if args.labels else None
    run_main(lambda: reload_logits(args.folder, args.inputs, args.output, labels, args.trust_remote_code,
                                   args.mixed_precision))


if __name__ == "__main__":
    from finetune.runtime.launch import die_with_launcher, isolate_sys_path

    isolate_sys_path()
    die_with_launcher()
    main()
