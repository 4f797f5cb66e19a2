"""finetune.backends.base: the Backend protocol's answers of every backend, against a table written out by hand: what
it shards, who casts, how the other ranks get weights, whether its checkpoints are rank-bound, its layout record, its
plan figures on 4 processes, and which checkpoint layouts it loads natively (Backend.resume_problem) for every pair of
backends and world sizes. What one family alone answers is in that module's test file (test_whole.py, test_fsdp.py,
test_deepspeed.py); how a backend is chosen is test_select.py's."""

from __future__ import annotations

import itertools

import pytest

from finetune.backends import Backend, DeepSpeed, Fsdp, backend_named, launcher_config_name, layout
from tests.backend_table import NAMES

# name: shards_parameters, casts_parameters, engine_owns_precision, sharded_scaler, syncs_each_micro_step,
#       weight_distribution, generates_unwrapped, rank_bound_state, whole_tensors, launcher config
ANSWERS = {
    "single": (False, False, False, False, False, "everywhere", True, False, True, "cpu"),
    "ddp": (False, False, False, False, False, "broadcast", True, False, True, "ddp"),
    "fsdp1": (True, True, False, True, True, "broadcast", False, True, False, "fsdp1"),
    "fsdp2": (True, True, False, False, True, "shard", True, True, False, "fsdp2"),
    "zero1": (False, False, True, False, False, "broadcast", True, True, False, "zero1"),
    "zero2": (False, False, True, False, False, "broadcast", True, True, False, "zero2"),
    "zero3": (True, False, True, False, False, "library", True, True, False, "zero3"),
    "zero3_offload": (True, False, True, False, False, "library", True, True, False, "zero3_offload"),
}

DEEPSPEED_FILES = "DeepSpeed pytorch_model/ (mp_rank_00_model_states.pt + zero_pp_rank_*_optim_states.pt)"
LAYOUT = {
    "single": ("whole tensors", "model.safetensors + optimizer.bin"),
    "ddp": ("whole tensors", "model.safetensors + optimizer.bin"),
    "fsdp1": ("FSDP1 flat-parameter shards (DCP)",
              "torch.distributed.checkpoint pytorch_model_fsdp_0/ + fsdp1_optimizer"),
    "fsdp2": ("FSDP2 DTensor shards (DCP)", "torch.distributed.checkpoint pytorch_model_fsdp_0/ + optimizer_0/"),
    "zero1": ("ZeRO-1 optimizer partitions", DEEPSPEED_FILES),
    "zero2": ("ZeRO-2 optimizer and gradient partitions", DEEPSPEED_FILES),
    "zero3": ("ZeRO-3 partitions", DEEPSPEED_FILES),
    "zero3_offload": ("ZeRO-3 partitions, optimizer on CPU", DEEPSPEED_FILES),
}

# name on 4 processes: kind, divisors of params / grads / optimizer states, params / optimizer on host, gathers,
# fp32 masters kept by the engine, parameters persisted under this many elements, DDP buckets, reduce bucket
PLAN = {
    "single": ("single", 1, 1, 1, False, False, False, False, 0, False, False),
    "ddp": ("ddp", 1, 1, 1, False, False, False, False, 0, True, False),
    "fsdp1": ("fsdp", 4, 4, 4, False, False, True, False, 0, False, False),
    "fsdp2": ("fsdp", 4, 4, 4, False, False, True, False, 0, False, False),
    "zero1": ("deepspeed", 1, 1, 4, False, False, False, True, 100_000, False, True),
    "zero2": ("deepspeed", 1, 4, 4, False, False, False, True, 100_000, False, True),
    "zero3": ("deepspeed", 4, 4, 4, False, False, True, True, 100_000, False, True),
    "zero3_offload": ("deepspeed", 4, 4, 4, False, True, True, True, 100_000, False, True),
}


@pytest.mark.parametrize("name", NAMES)
def test_each_backend_answers_as_the_table_says(name: str) -> None:
    backend = backend_named(name)
    assert backend.name == name
    assert (backend.shards_parameters, backend.casts_parameters, backend.engine_owns_precision,
            backend.sharded_scaler, backend.syncs_each_micro_step, backend.weight_distribution,
            backend.generates_unwrapped, backend.rank_bound_state, backend.whole_tensors,
            backend.launcher_config) == ANSWERS[name]


@pytest.mark.parametrize("name", NAMES)
def test_layout_records_are_the_manifest_strings(name: str) -> None:
    sharding, files = LAYOUT[name]
    assert layout(name, 3) == {"backend": name, "world_size": 3, "sharding": sharding, "format": files}


def test_layout_of_names_no_backend_has() -> None:
    assert layout("zero2_offload", 2)["sharding"] == "unknown"  # never written to a manifest's sharding table
    assert layout("zero2_offload", 2)["format"] == DEEPSPEED_FILES
    assert layout("tpu", 2) == {"backend": "tpu", "world_size": 2, "sharding": "unknown", "format": "unknown"}
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        backend_named("tpu")


@pytest.mark.parametrize("name", NAMES)
def test_plan_figures_on_four_processes(name: str) -> None:
    backend = backend_named(name)
    split = backend.split(4)
    assert (split.kind, split.params, split.grads, split.optimizer, split.params_on_host, split.optimizer_on_host,
            split.gathers, backend.keeps_fp32_master_weights, backend.persistence_threshold,
            backend.keeps_gradient_buckets, backend.has_reduce_bucket) == PLAN[name]
    assert split.backend == ("single" if name == "single" else name)


def test_plan_descriptions() -> None:
    assert backend_named("ddp").split(2).description == \
        "DDP over 2 processes: nothing sharded, gradient buckets hold a second copy of the gradients"
    assert backend_named("ddp").split(1).description == "single process: nothing sharded"
    assert backend_named("zero3").split(2, in_this_process=True).description == \
        "single process: nothing sharded (one process trains in this process, so the accelerate config does not apply)"
    assert DeepSpeed(3, "cpu", "cpu").split(2).description == \
        "DeepSpeed ZeRO-3: parameters, gradients and optimizer states / 2; optimizer states and parameters " \
        "offloaded to CPU memory"
    hybrid = Fsdp(1, config={"fsdp_sharding_strategy": "HYBRID_SHARD"}).split(8, num_machines=2)
    assert (hybrid.params, hybrid.grads, hybrid.description) == (
        4, 4, "FSDP HYBRID_SHARD: parameters, gradients and optimizer states / 4 (within each machine)")


BACKENDS = [backend_named(name) for name in NAMES]
WHOLE = {"single", "ddp"}


@pytest.mark.parametrize(("saved", "now"), list(itertools.product(BACKENDS, BACKENDS)), ids=lambda b: b.name)
@pytest.mark.parametrize(("saved_world", "world"), [(2, 2), (2, 1), (1, 2)])
def test_which_layouts_load(saved: Backend, now: Backend, saved_world: int, world: int) -> None:
    """Single and DDP checkpoints hold whole tensors (any world size, either backend); a sharded backend loads only
    its own format on the world size that wrote it."""
    problem = now.resume_problem(saved.name, saved_world, world)
    if saved.name in WHOLE and now.name in WHOLE:
        assert problem is None  # whole tensors: any world size, either backend
    elif saved.name == now.name and saved_world == world:
        assert problem is None
    else:
        assert problem is not None
        config = launcher_config_name(saved)  # single's accelerate config is "cpu"
        assert f"--num-processes {saved_world}" in problem and f"--accelerate-config {config}" in problem
