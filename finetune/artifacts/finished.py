"""Whether ``finetune resume RUN`` has anything to do: a finished run is left as it is, in one line.

A run is finished when its newest resumable checkpoint is at its last step (``train.max_steps``, or the steps that
``train.epochs`` makes of the train set) and ``final/`` was exported from that step (or the recipe exports none).
Resuming it would train nothing and only write ``final/`` again, so ``finetune resume`` says so and exits 0
(:func:`nothing_to_resume`). The check is as strict as a resume's own: the run must be unlocked, its marker and
layout sound, the checkpoint verified (every file's sha256) and the command's overrides must change nothing but the
layout, and the data files must be those the checkpoint recorded; otherwise (``train.max_steps=N`` to train
longer, a changed key or data file, anything damaged) the resume goes ahead
and says what it says. Reads JSON and YAML only: no model, no plugin is imported, nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.artifacts import checkpoint, rundir
from finetune.artifacts.resume import data_changes, recipe_changes
from finetune.config import RecipeConfig, compose, remote_code_from_flag
from finetune.errors import FinetuneError
from finetune.runtime.worker import total_steps


def nothing_to_resume(run_dir: Path, overrides: list[str], trust_remote_code: bool) -> str | None:
    """The line ``finetune resume`` prints for a finished run (see the module); None when there is work to do or
    the run cannot be read as finished (the resume then reports what is wrong)."""

    try:
        if not run_dir.is_dir():
            return None
        run_id = rundir.run_id(run_dir)
        rundir.check_layout(run_dir)
        rundir.RunLock.check_free(run_dir)
        info = checkpoint.latest_resumable(run_dir)
        if info is None or info.step is None:
            return None
        stored = info.path / rundir.RESOLVED
        here = f"output_dir={run_dir.resolve()}"
        # pydantic's validation only: the semantic checks import a recipe's model.plugin, which resume gates
        cfg = RecipeConfig.model_validate(
            compose(stored, [*remote_code_from_flag(overrides, trust_remote_code), here]).data)
        before = RecipeConfig.model_validate(compose(stored, [here]).data)
        state = json.loads((info.path / rundir.TRAIN_STATE).read_text(encoding="utf-8"))
        total = total_steps(cfg, int(state.get("train_size") or 0))
        if info.step < total or recipe_changes(before.model_dump(mode="json"), cfg.model_dump(mode="json"))[0]:
            return None
        if cfg.checkpoint.save_final and rundir.read_manifest(run_dir / rundir.FINAL).get("step") != info.step:
            return None  # the export is what is left to do
        if data_changes(cfg, rundir.read_manifest(info.path)):
            return None  # a changed data file: the resume says so (and refuses) rather than "nothing to do"
        checkpoint.verify(info.path, run_id)
    except (FinetuneError, OSError, ValueError, TypeError, AttributeError):
        return None
    exported = f"{rundir.FINAL}/ exported at that step" if cfg.checkpoint.save_final else "no export asked for"
    return (f"{run_dir}: finished, nothing to resume ({info.path.name} is step {info.step} of {total}; {exported}). "
            f"Train longer: `finetune resume {run_dir} train.max_steps=N --allow-config-change`; evaluate: "
            f"`finetune eval {run_dir}`")
