"""Hooks for tests/distributed/test_fsdp_precision.py, loaded on every rank through FINETUNE_HOOKS: what precision
really runs inside an FSDP training step.

After step 1 every module of the wrapped model gets a forward pre-hook, and ``torch.distributed``'s
``reduce_scatter_single`` (FSDP1's and FSDP2's gradient reduce-scatter, looked up on the module at each call) is
wrapped. During step 2 (the test's recipe accumulates 2 micro-batches per step) they record, in order, each training
forward of the whole model and each gradient reduce-scatter with its input dtype, plus the dtypes of the weights that
the model's layers hold inside their forward and whether autocast was on there. After step 2 each rank writes them
to ``<run_dir>.precision-<rank>.json`` with the dtypes of the parameters the optimizer updates (the master weights).

During step 2 a saved-tensors hook also sorts what autograd saves for backward in each training forward: 16-bit
2-D tensors shaped as a linear layer's weight (or its transpose) are either that layer's own weight (its storage:
FSDP's gathered 16-bit parameter, which FSDP frees after forward and gathers again) or a copy of it (autocast's cast,
which lives until backward). Per forward, the bytes of the distinct storages of each kind (by address) are recorded
(``saved_weights``: {"own", "copies"}).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import torch
import torch.distributed as dist

from finetune import hooks
from tests.distributed.paths import side_file

RECORD_STEP = 2
_seen: dict[str, Any] = {"recording": False, "events": [], "weight_dtypes": set(), "autocast": set(),
                         "saved_weights": [], "linears": [], "saving": None}


def _reduce_scatter_recorder(original: Any) -> Any:
    def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _seen["recording"]:
            _seen["events"].append(f"reduce_scatter:{input.dtype}")
        return original(output, input, *args, **kwargs)

    return reduce_scatter_single


def _layer_pre_hook(module: torch.nn.Module, args: Any) -> None:
    if _seen["recording"] and module.training:
        for param in module.parameters(recurse=False):
            _seen["weight_dtypes"].add(str(param.dtype))
        _seen["autocast"].add(torch.is_autocast_enabled("cpu"))


def _root_pre_hook(module: torch.nn.Module, args: Any) -> None:
    if _seen["recording"] and module.training:
        _seen["events"].append("forward")
        _seen["saved_weights"].append({"own": {}, "copies": {}})


def _pack(tensor: torch.Tensor) -> torch.Tensor:
    """Sort a tensor autograd saves (see the module docstring); every tensor is saved unchanged."""
    if not (_seen["recording"] and _seen["saved_weights"] and tensor.dim() == 2
            and tensor.dtype in (torch.bfloat16, torch.float16)):
        return tensor
    weights = {}  # storage address -> shape of the linear layers' weights as the forward sees them now
    for module in _seen["linears"]:
        with contextlib.suppress(RuntimeError, NotImplementedError):  # a sharded DTensor outside its forward
            weights[module.weight.untyped_storage().data_ptr()] = tuple(module.weight.shape)
    shapes = set(weights.values()) | {shape[::-1] for shape in weights.values()}
    storage = tensor.untyped_storage()
    if tuple(tensor.shape) in shapes:
        kind = "own" if storage.data_ptr() in weights else "copies"
        _seen["saved_weights"][-1][kind][str(storage.data_ptr())] = storage.nbytes()
    return tensor


def _after_step(trainer: Any) -> None:
    step = trainer.state.step
    if step == RECORD_STEP - 1:
        trainer.model.register_forward_pre_hook(_root_pre_hook)
        for module in trainer.model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.register_forward_pre_hook(_layer_pre_hook)
        dist.reduce_scatter_single = _reduce_scatter_recorder(dist.reduce_scatter_single)
        _seen["linears"] = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)]
        _seen["saving"] = torch.autograd.graph.saved_tensors_hooks(_pack, lambda tensor: tensor)
        _seen["saving"].__enter__()
        _seen["recording"] = True
    elif step == RECORD_STEP:
        _seen["recording"] = False
        _seen["saving"].__exit__(None, None, None)
        master = {str(p.dtype) for group in trainer.optimizer.param_groups for p in group["params"]}
        facts = {"events": _seen["events"], "weight_dtypes": sorted(_seen["weight_dtypes"]),
                 "autocast": sorted(_seen["autocast"]), "master_dtypes": sorted(master),
                 "saved_weights": [{kind: sum(sizes.values()) for kind, sizes in forward.items()}
                                   for forward in _seen["saved_weights"]],
                 "grad_accum": trainer.ctx.cfg.grad_accum, "backend": trainer.ctx.backend.name,
                 "num_processes": trainer.ctx.accelerator.num_processes}
        rank = trainer.ctx.accelerator.process_index
        side_file(trainer.ctx.run_dir, f"precision-{rank}.json").write_text(json.dumps(facts))


hooks.register("after_step", _after_step)
