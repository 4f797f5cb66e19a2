"""finetune.backends.whole: one process and DDP, the backends whose tensors are whole. Their names, their launcher's
accelerate config, and their plan split; what they answer next to every other backend is test_backends.py's."""

from __future__ import annotations

from finetune.backends import WholeModel


def test_only_single_and_ddp_are_whole_model_names() -> None:
    assert WholeModel.from_name("single") == WholeModel("single")
    assert WholeModel.from_name("ddp") == WholeModel("ddp")
    assert WholeModel.from_name("fsdp2") is None and WholeModel.from_name("zero1") is None
    assert WholeModel.from_name("DDP") is None


def test_one_process_launches_with_the_cpu_config() -> None:
    assert WholeModel("single").launcher_config == "cpu" and WholeModel("ddp").launcher_config == "ddp"
    assert WholeModel("single").single_process and not WholeModel("ddp").single_process


def test_ddp_splits_nothing_and_keeps_gradient_buckets() -> None:
    split = WholeModel("ddp").split(3)
    assert (split.backend, split.kind, split.world, split.params, split.grads, split.optimizer) == \
        ("ddp", "ddp", 3, 1, 1, 1)
    assert WholeModel("ddp").keeps_gradient_buckets and not WholeModel("single").keeps_gradient_buckets
    alone = WholeModel("ddp").split(1)  # DDP on one process is one process
    assert (alone.backend, alone.kind, alone.world) == ("single", "single", 1)
