"""finetune.backends.accelerator without an Accelerator: the process group's keywords every backend passes on (the
recipe's timeout; gloo for DeepSpeed on a CPU-only machine). tests/distributed/test_timeouts.py runs them on 2
processes."""

from __future__ import annotations

from datetime import timedelta

import pytest

from finetune.backends import Backend, backend_named, process_group_kwargs
from tests.backend_table import recipe


@pytest.mark.parametrize("backend", [backend_named("single"), backend_named("ddp"), backend_named("fsdp1"),
                                     backend_named("fsdp2"), backend_named("zero3")],
                         ids=lambda b: b.name)
@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu", "gpu"])
def test_every_backend_gets_the_recipes_timeout(backend: Backend, on_cpu: bool) -> None:
    kwargs = process_group_kwargs(recipe(timeout_minutes=10), backend, on_cpu)
    assert kwargs["timeout"] == timedelta(minutes=10)
    assert kwargs.get("backend") == ("gloo" if backend.kind == "deepspeed" and on_cpu else None)
