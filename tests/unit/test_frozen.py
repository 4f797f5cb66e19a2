"""finetune.backends.frozen.FrozenShards on one process: the copy holds the weights of the moment it was built, a
forward pass inside ``swapped`` uses them, and the live weights are back afterwards, also after an error. A module
that FSDP2 did not wrap holds its parameters whole (its shards are the parameters); a ZeRO-3 engine's shards are each
parameter's ``ds_tensor``, released from any gathered copy before every read (tests/distributed/test_grpo.py uses it
on real sharded models)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune.backends import FrozenShards

ONES = torch.tensor([[1.0, 1.0]])


def _linear(weight: list[float], bias: float) -> torch.nn.Linear:
    """y = weight . x + bias, with the values given."""
    model = torch.nn.Linear(2, 1)
    _set(model, weight, bias)
    return model


def _set(model: torch.nn.Linear, weight: list[float], bias: float) -> None:
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weight]))
        model.bias.fill_(bias)


def test_the_copy_scores_inside_and_the_live_weights_are_back_after() -> None:
    model = _linear([1.0, 2.0], 3.0)
    frozen = FrozenShards(model, deepspeed=False)
    _set(model, [5.0, 6.0], 7.0)  # training moves on
    with frozen.swapped():
        assert model(ONES).item() == 6.0  # 1 + 2 + 3
    assert model(ONES).item() == 18.0  # 5 + 6 + 7
    assert model.weight.tolist() == [[5.0, 6.0]] and model.bias.tolist() == [7.0]


def test_an_error_inside_leaves_the_live_weights() -> None:
    model = _linear([1.0, 2.0], 3.0)
    frozen = FrozenShards(model, deepspeed=False)
    _set(model, [5.0, 6.0], 7.0)
    with pytest.raises(RuntimeError, match="scoring failed"), frozen.swapped():
        raise RuntimeError("scoring failed")
    assert model.weight.tolist() == [[5.0, 6.0]] and model.bias.tolist() == [7.0]


def test_a_zero3_engine_swaps_its_partitions() -> None:
    """Each parameter's partition (``ds_tensor``) is what is copied and swapped; the engine releases its gathered
    parameters before every read of the partitions (when built, entering and leaving)."""
    module = torch.nn.Linear(2, 1)
    module.weight.ds_tensor = torch.tensor([1.0])  # this rank's part of the weight
    module.bias.ds_tensor = torch.tensor([3.0])
    released: list[int] = []
    engine = SimpleNamespace(module=module, empty_partition_cache=lambda: released.append(1))
    frozen = FrozenShards(engine, deepspeed=True)
    module.weight.ds_tensor.fill_(5.0)
    module.bias.ds_tensor.fill_(7.0)
    with frozen.swapped():
        assert (module.weight.ds_tensor.item(), module.bias.ds_tensor.item()) == (1.0, 3.0)
    assert (module.weight.ds_tensor.item(), module.bias.ds_tensor.item()) == (5.0, 7.0)
    assert len(released) == 3
