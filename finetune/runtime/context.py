"""What a run is, fixed for its whole life: the recipe, the run folder, the process layout and the tokenizer.

:class:`RunContext` is built once per process by the worker (finetune.runtime.worker) and handed, whole, to the loop,
the checkpoint writer and the export; none of them can change it (it is frozen), so a value read at step 1 is the one
read at the last step. What moves during a run (the model, the optimizer, the train state, ...) is the
:class:`finetune.runtime.loop.Trainer`'s. Imports nothing heavy: the front process may name it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.config import RecipeConfig
from finetune.registry import SupportedModel

if TYPE_CHECKING:
    from finetune.backends import Backend


@dataclass(frozen=True)
class RunContext:
    """The unchanging facts of one run on this rank.

    ``cfg``: the resolved recipe. ``run_dir``: the run folder. ``run_id``: its id (manifests and exports carry it).
    ``row``: the recipe's registry row (registry.recipe_row), resolved once. ``labels``: the classification label
    names (None for other tasks), recorded in manifests. ``backend``: the distributed backend, an opaque value handed
    to the checkpoint and export code. ``accelerator``: accelerate's Accelerator of this process. ``tokenizer``: the
    run's tokenizer (its fingerprint goes into each checkpoint; the export saves it). ``max_steps``: the optimizer
    steps the run ends at."""

    cfg: RecipeConfig
    run_dir: Path
    run_id: str
    row: SupportedModel
    labels: list[str] | None
    backend: Backend
    accelerator: Any
    tokenizer: Any
    max_steps: int
