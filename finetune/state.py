"""TrainState: the loop's own counters, saved in every checkpoint (accelerate saves none of them)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainState:
    """Where training is. ``samples_seen`` (global, over all ranks) is the data cursor: with the dataset size it
    gives the epoch and the position in it, independent of world size and micro-batch size."""

    step: int = 0
    micro_step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    best_eval_loss: float = math.inf

    def epoch(self, dataset_size: int) -> int:
        """The epoch the next sample belongs to."""
        return self.samples_seen // max(1, dataset_size)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
