"""What each process of a test run reads from a model folder's weights, and what each rank holds after step 1.

Imported at interpreter start by a ``sitecustomize.py`` that tests/distributed/test_load_once.py writes on the
PYTHONPATH of its runs, so it is in place before transformers or safetensors load anything. With
``FINETUNE_TEST_READS=<folder>`` and ``FINETUNE_TEST_WEIGHTS=<model folder>``:

- ``safetensors.safe_open`` is wrapped: every tensor the process takes out of a ``*.safetensors`` file of the model
  folder (``get_tensor``, or indexing a ``get_slice``) is recorded, and so is any Python-level open of such a file
  (an audit hook: transformers reads whole files that way where it does not map them). Reading the header (keys,
  shapes, dtypes) is not a read of the weights and is recorded apart.
- after the first optimizer step each rank records what it holds: a digest of every buffer, of every parameter
  when parameters are replicated (DDP), and whether the output embedding is still the input embedding.

Records go to ``<folder>/<rank>-<pid>.jsonl`` (rank ``main`` outside a launcher), beside the run dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

_OUT = os.environ.get("FINETUNE_TEST_READS")
_WEIGHTS = os.environ.get("FINETUNE_TEST_WEIGHTS")


def _record(**row: Any) -> None:
    assert _OUT is not None
    rank = os.environ.get("RANK", "main")
    with open(Path(_OUT) / f"{rank}-{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps({"rank": rank, **row}) + "\n")


def _watched(filename: Any) -> bool:
    name = os.fspath(filename) if isinstance(filename, (str, os.PathLike)) else ""
    return name.endswith(".safetensors") and _WEIGHTS is not None and \
        os.path.realpath(name).startswith(os.path.realpath(_WEIGHTS) + os.sep)


class _Slice:
    """A ``get_slice`` handle: indexing it reads tensor data."""

    def __init__(self, inner: Any, filename: str, key: str) -> None:
        self._inner, self._file, self._key = inner, filename, key

    def __getitem__(self, index: Any) -> Any:
        _record(kind="data", file=self._file, key=self._key, via="slice")
        return self._inner[index]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Handle:
    """A ``safe_open`` handle that records the tensors taken out of it."""

    def __init__(self, inner: Any, filename: str) -> None:
        self._inner, self._file = inner, filename

    def __enter__(self) -> _Handle:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def get_tensor(self, key: str) -> Any:
        _record(kind="data", file=self._file, key=key, via="get_tensor")
        return self._inner.get_tensor(key)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._inner.get_slice(key), self._file, key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _install_read_probe() -> None:
    import safetensors

    real = safetensors.safe_open

    def safe_open(filename: Any, *args: Any, **kwargs: Any) -> Any:
        handle = real(filename, *args, **kwargs)
        if not _watched(filename):
            return handle
        _record(kind="header", file=os.fspath(filename))
        return _Handle(handle, os.fspath(filename))

    safetensors.safe_open = safe_open  # before anything does `from safetensors import safe_open`

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and args and _watched(args[0]):
            _record(kind="data", file=os.fspath(args[0]), key="*", via="open")

    sys.addaudithook(audit)


def _digest(tensor: Any) -> str:
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(dtype=torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def _after_step(trainer: Any) -> None:
    if trainer.state.step != 1:
        return
    model = trainer.ctx.accelerator.unwrap_model(trainer.model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA: the base's names
    held: dict[str, Any] = {"buffers": {name: _digest(b) for name, b in base.named_buffers()}}
    if not trainer.ctx.backend.shards_parameters:
        held["params"] = {name: _digest(p) for name, p in model.named_parameters()}
    held["tied"] = base.get_output_embeddings().weight is base.get_input_embeddings().weight
    _record(kind="held", step=1, **held)


if _OUT and _WEIGHTS:
    _install_read_probe()
    from finetune import hooks

    hooks.register("after_step", _after_step)
