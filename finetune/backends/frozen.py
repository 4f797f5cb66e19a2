"""A frozen copy of a sharded model's weights, sharded as the model is (FSDP2 and ZeRO-3)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class FrozenShards:
    """This rank's shards of every parameter of a prepared FSDP2 module or ZeRO-3 engine, copied when built: a
    frozen copy of the weights at that moment, sharded as the model is. :meth:`swapped` puts them into the model's
    parameters and the live shards back afterwards, so a forward pass inside it gathers the copy's weights.

    Both backends gather a parameter from its local shard in each forward (FSDP2: the DTensor's local tensor, a view
    of the flat data it all-gathers; ZeRO-3: ``ds_tensor``), so every parameter is first released to its shard
    (FSDP2 ``reshard``; ZeRO-3 ``empty_partition_cache``, which also releases the parameters it keeps gathered
    between forwards): an unsharded copy left from an earlier forward would otherwise be used as it is."""

    def __init__(self, model: Any, *, deepspeed: bool) -> None:
        import torch  # lazy: heavy

        self.model, self.deepspeed = model, deepspeed
        module = model.module if deepspeed else model
        self.params = list(dict.fromkeys(module.parameters()))
        with torch.no_grad():
            self.saved = [shard.detach().clone() for shard in self._shards()]

    def _shards(self) -> list[Any]:
        """Every parameter's local shard, after releasing any gathered copy (a view: writing it writes the shard)."""
        if self.deepspeed:
            self.model.empty_partition_cache()
            return [p.ds_tensor for p in self.params]
        from torch.distributed.fsdp import FSDPModule  # lazy: heavy
        from torch.distributed.tensor import DTensor  # lazy: heavy

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return [p._local_tensor if isinstance(p, DTensor) else p.data for p in self.params]

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The model's parameters hold the copy's shards inside, the live ones again after (also on an error)."""
        import torch  # lazy: heavy

        with torch.no_grad():
            live = self._shards()
            kept = [shard.clone() for shard in live]
            for shard, saved in zip(live, self.saved, strict=True):
                shard.copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for shard, value in zip(self._shards(), kept, strict=True):
                    shard.copy_(value)
