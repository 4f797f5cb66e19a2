"""finetune.backends.deepspeed without DeepSpeed running: the only backend that needs a package, its refusal to
reshard anything but AdamW state, which stages keep an fp32 master copy, the DeepSpeed config generated from the
recipe, and the reduce bucket capped at the trainable parameters (the plan counts it: test_plan.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from finetune.backends import DeepSpeed, backend_named, deepspeed_config, reduce_bucket_elements, size_deepspeed_buckets
from finetune.config import RecipeConfig
from tests.backend_table import NAMES


def test_only_deepspeed_needs_a_package_and_refuses_sgd_resharding() -> None:
    assert [name for name in NAMES if backend_named(name).package] == ["zero1", "zero2", "zero3", "zero3_offload"]
    assert backend_named("zero2").reshard_problem("sgd") is not None
    assert backend_named("zero2").reshard_problem("adamw") is None
    assert backend_named("fsdp2").reshard_problem("sgd") is None


def test_master_copies() -> None:
    """ZeRO-1/2 always keep an fp32 copy; ZeRO-3 only in 16 bits or with the optimizer offloaded; others never."""
    assert backend_named("zero1").holds_master_copy(False) and backend_named("zero2").holds_master_copy(False)
    assert not backend_named("zero3").holds_master_copy(False) and backend_named("zero3").holds_master_copy(True)
    assert backend_named("zero3_offload").holds_master_copy(False)
    assert not any(backend_named(name).holds_master_copy(True) for name in ("single", "ddp", "fsdp1", "fsdp2"))


def test_the_config_is_the_recipes() -> None:
    """Batch sizes, accumulation (16 / (2 x 2 processes) = 4), clipping, precision and the ZeRO settings all come from
    the recipe and the backend, so the two can never disagree."""
    cfg = RecipeConfig.model_validate({
        "name": "t", "model": {"type": "tiny-llama"}, "data": {"format": "alpaca", "train": "x.jsonl"},
        "train": {"max_steps": 1, "micro_batch_size": 2, "global_batch_size": 16, "max_grad_norm": 0.5,
                  "mixed_precision": "bf16"},
        "launch": {"num_processes": 2}})
    config = deepspeed_config(cfg, DeepSpeed(3, offload_optimizer="cpu"), pin_memory=True)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"], config["gradient_clipping"]) == (16, 2, 4, 0.5)
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                           "offload_param": {"device": "none"},
                                           "stage3_gather_16bit_weights_on_model_save": True}
    assert deepspeed_config(cfg, DeepSpeed(2))["zero_optimization"]["offload_optimizer"] == {"device": "none"}


def test_the_reduce_bucket_is_capped_at_the_trainable_parameters() -> None:
    assert reduce_bucket_elements(7_000_000_000) == 500_000_000  # DeepSpeed's default
    assert reduce_bucket_elements(1234) == 1234
    assert reduce_bucket_elements(0) == 1
    model = torch.nn.Linear(3, 4)  # 12 weights + 4 biases
    model.bias.requires_grad_(False)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config={})))
    size_deepspeed_buckets(accelerator, model)
    assert accelerator.state.deepspeed_plugin.deepspeed_config == {"zero_optimization": {"reduce_bucket_size": 12}}
    size_deepspeed_buckets(SimpleNamespace(state=SimpleNamespace()), model)  # not DeepSpeed: nothing to size
