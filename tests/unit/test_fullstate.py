"""finetune.backends.fullstate: what every backend's full-state load shares. A loaded optimizer state keeps this
build's kernel choice (``fused``, ``foreach``, ...: how this machine computes a step, not what the step is), and a
checkpoint's parameter names are cleaned of wrapper prefixes the same way on every layout."""

from __future__ import annotations

import torch

from finetune.backends.fullstate import KERNEL_KEYS, clean_name, keep_kernel_choice, kernel_choice, live_groups


def test_a_load_keeps_this_builds_kernel_choice() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param], foreach=False)
    param.grad = torch.ones(2)
    optimizer.step()
    keep_kernel_choice(optimizer, [{"foreach": True}])
    assert optimizer.param_groups[0]["foreach"] is True
    assert optimizer.state[param]["step"].device.type == "cpu" and float(optimizer.state[param]["step"]) == 1.0
    keep_kernel_choice(optimizer, [{"foreach": False}, {"foreach": False}])  # another grouping: left as loaded
    assert optimizer.param_groups[0]["foreach"] is True


def test_the_kernel_choice_is_the_groups_kernel_keys_only() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param], lr=0.1, foreach=False)
    assert set(KERNEL_KEYS) == {"fused", "foreach", "capturable", "differentiable"}
    choice = kernel_choice(optimizer)
    assert len(choice) == 1 and choice[0]["foreach"] is False and "lr" not in choice[0]
    saved = {"state": {}, "param_groups": [{"lr": 0.5, "foreach": True, "fused": True, "params": ["w"]}]}
    live = live_groups(saved, optimizer)["param_groups"][0]
    assert live["lr"] == 0.5 and live["foreach"] is False and live["params"] == ["w"]


def test_wrapper_prefixes_are_cleaned_from_parameter_names() -> None:
    assert clean_name("_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.weight") == \
        "model.layers.0.mlp.weight"
    assert clean_name("_orig_mod.lm_head.weight") == "lm_head.weight"
