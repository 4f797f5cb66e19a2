"""How a checkpoint's state is laid out, as its manifest says: the backend, the world size and the sharding.

Manifests carry a ``layout`` record (``finetune.backends.layout``: backend, world_size, sharding, format); older
ones only the top-level ``backend`` and ``world_size``. Both are read here, without torch (``finetune ls`` uses
this), and never trusted to be well formed: a manifest is data a user can damage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Which backend on how many processes wrote a checkpoint, and how that splits its state (None: not said)."""

    backend: str
    world_size: int | None
    sharding: str | None

    def describe(self) -> str:
        """``fsdp2 x2, FSDP2 DTensor shards (DCP)``, ``single x1``: one short phrase for listings and messages."""
        world = f" x{self.world_size}" if self.world_size is not None else ""
        return f"{self.backend}{world}" + (f", {self.sharding}" if self.sharding else "")


def of(manifest: dict[str, Any]) -> Layout:
    """The layout a checkpoint manifest records (its ``layout`` record, else its top-level keys; ``single`` on
    one process when it says nothing)."""
    record = manifest.get("layout")
    record = record if isinstance(record, dict) else {}
    backend = record.get("backend", manifest.get("backend", "single"))
    world = record.get("world_size", manifest.get("world_size", 1))
    sharding = record.get("sharding")
    return Layout(str(backend) if isinstance(backend, str) and backend else "unknown",
                  world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else None,
                  sharding if isinstance(sharding, str) and sharding else None)
