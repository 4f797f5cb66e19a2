"""Backend.resume_problem: which checkpoint layouts a backend can load, for every pair of backends and world sizes.
Single and DDP checkpoints hold whole tensors (any world size, either backend); a sharded backend loads only its
own format on the world size that wrote it."""

from __future__ import annotations

import itertools

import pytest

from finetune.backends import Backend, backend_named, launcher_config_name

BACKENDS = [backend_named("single"), backend_named("ddp"), backend_named("fsdp1"), backend_named("fsdp2"),
            backend_named("zero1"), backend_named("zero2"), backend_named("zero3"),
            backend_named("zero3_offload")]
WHOLE = {"single", "ddp"}


@pytest.mark.parametrize(("saved", "now"), list(itertools.product(BACKENDS, BACKENDS)), ids=lambda b: b.name)
@pytest.mark.parametrize(("saved_world", "world"), [(2, 2), (2, 1), (1, 2)])
def test_which_layouts_load(saved: Backend, now: Backend, saved_world: int, world: int) -> None:
    problem = now.resume_problem(saved.name, saved_world, world)
    if saved.name in WHOLE and now.name in WHOLE:
        assert problem is None  # whole tensors: any world size, either backend
    elif saved.name == now.name and saved_world == world:
        assert problem is None
    else:
        assert problem is not None
        config = launcher_config_name(saved)  # single's accelerate config is "cpu"
        assert f"--num-processes {saved_world}" in problem and f"--accelerate-config {config}" in problem
