"""finetune.backends.select: which backend runs, from the launcher's environment (detect), an accelerate config's
settings (from_accelerate_config) or a shipped accelerate config by name (accelerate_config); the three constructors
and a manifest's name build the same objects."""

from __future__ import annotations

from finetune.backends import Fsdp, WholeModel, accelerate_config, backend_named, detect, from_accelerate_config


def test_the_three_constructors_agree() -> None:
    """The launcher's environment, an accelerate config's settings and a manifest's name build the same objects."""
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}
    settings = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3,
                                                                      "offload_optimizer_device": "cpu"}}
    assert detect(env) == from_accelerate_config(settings) == backend_named("zero3_offload")
    assert detect({"ACCELERATE_USE_FSDP": "1", "FSDP_VERSION": "2"}) == backend_named("fsdp2")
    assert detect({"WORLD_SIZE": "2"}) == backend_named("ddp") == WholeModel("ddp")
    assert detect({}) == from_accelerate_config({}) == backend_named("single")
    assert isinstance(from_accelerate_config({"distributed_type": "FSDP"}), Fsdp)


def test_a_shipped_accelerate_config_by_name() -> None:
    """accelerate_configs/zero3_offload.yaml: one machine, ZeRO-3 with the optimizer on the CPU, no port of its own;
    multi_node_example.yaml: FSDP2 over 2 machines, rendezvous on the port it names."""
    zero3 = accelerate_config("zero3_offload")
    assert zero3.backend == backend_named("zero3_offload") and zero3.path.name == "zero3_offload.yaml"
    assert (zero3.machines, zero3.names_port, zero3.settings["distributed_type"]) == (1, False, "DEEPSPEED")
    multi = accelerate_config("multi_node_example")
    assert multi.backend == backend_named("fsdp2")
    assert (multi.machines, multi.names_port) == (2, True)
