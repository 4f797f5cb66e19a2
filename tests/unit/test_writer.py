"""finetune.artifacts.writer's pieces that need no model: the one finite-weight check and an export manifest's head."""

from __future__ import annotations

import torch

from finetune import __version__
from finetune.artifacts.writer import all_finite, export_manifest


def test_all_finite_checks_only_floating_point_tensors() -> None:
    assert all_finite({"w": torch.ones(2), "step": torch.tensor([2**62]), "name": "x"})
    assert all_finite(None) and all_finite({})
    assert not all_finite({"w": torch.tensor([1.0, float("nan")])})
    assert not all_finite({"w": torch.ones(2), "b": torch.tensor([float("-inf")], dtype=torch.bfloat16)})


def test_an_export_manifest_names_its_run_step_and_version() -> None:
    head = export_manifest("abc", 40)
    assert {key: head[key] for key in ("kind", "run_id", "step", "finetune")} == {
        "kind": "export", "run_id": "abc", "step": 40, "finetune": __version__}
    assert set(head) == {"kind", "run_id", "step", "created", "finetune"}
