"""finetune.backends.setup without a process group: the recipe's collective timeout, why it does not go through
accelerate's InitProcessGroupKwargs (start_process_group passes it to PartialState as it is), and a parameter's
whole shape and size whichever backend holds it (tests/distributed/test_timeouts.py runs the timeout on 2
processes)."""

from __future__ import annotations

from datetime import timedelta

import torch

from finetune.backends import full_numel, full_shape
from finetune.backends.setup import timeout
from tests.backend_table import recipe


def test_the_timeout_is_the_recipes_minutes() -> None:
    assert timeout(recipe(timeout_minutes=10)) == timedelta(minutes=10)
    assert timeout(recipe(timeout_minutes=0.5)) == timedelta(seconds=30)


def test_why_the_timeout_does_not_go_through_init_process_group_kwargs() -> None:
    """accelerate's handler passes on only fields that differ from its NCCL defaults: 10 minutes is dropped even
    for gloo (whose torch default is 30). If this starts failing, accelerate fixed it."""
    from accelerate.utils import InitProcessGroupKwargs

    assert "timeout" not in InitProcessGroupKwargs(backend="gloo", timeout=timedelta(minutes=10)).to_kwargs()


def test_a_plain_tensor_is_its_own_shape() -> None:
    assert full_shape(torch.zeros(3, 4)) == (3, 4)
    assert full_numel(torch.zeros(3, 4)) == 12
    assert full_shape(torch.nn.Parameter(torch.zeros(5))) == (5,) and full_numel(torch.zeros(())) == 1


def test_a_partition_reports_the_whole_parameter() -> None:
    """A ZeRO-3 parameter built partitioned is an empty placeholder whose whole shape is ``ds_shape``; an FSDP1 flat
    parameter is 1-D, its whole size ``_unpadded_unsharded_size``."""
    zero3 = torch.nn.Parameter(torch.empty(0))
    zero3.ds_shape = torch.Size([3, 4])
    assert full_shape(zero3) == (3, 4) and full_numel(zero3) == 12
    flat = torch.nn.Parameter(torch.zeros(8))  # this rank's half of a padded 14-element flat parameter
    flat._unpadded_unsharded_size = torch.Size([14])
    assert full_shape(flat) == (14,) and full_numel(flat) == 14
