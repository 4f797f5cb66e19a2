"""finetune.storage.layout: the backend, world size and sharding a checkpoint's manifest records, read from new
manifests, from old ones (top-level keys only) and from damaged ones without raising."""

from __future__ import annotations

from finetune.storage import layout


def test_the_layout_of_new_old_and_damaged_manifests() -> None:
    new = {"backend": "fsdp2", "world_size": 2,
           "layout": {"backend": "fsdp2", "world_size": 2, "sharding": "FSDP2 DTensor shards (DCP)", "format": "x"}}
    assert layout.of(new) == layout.Layout("fsdp2", 2, "FSDP2 DTensor shards (DCP)")
    assert layout.of(new).describe() == "fsdp2 x2, FSDP2 DTensor shards (DCP)"
    old = {"backend": "zero3", "world_size": 4}
    assert layout.of(old).describe() == "zero3 x4"
    assert layout.of({}).describe() == "single x1"
    damaged = {"layout": ["not", "a", "record"], "backend": 7, "world_size": "two"}
    assert layout.of(damaged) == layout.Layout("unknown", None, None)
    assert layout.of({"layout": {"backend": "ddp", "world_size": True}}).describe() == "ddp"
