"""Test plugin: the ``llama`` row with parts that ``model.freeze`` can name, registered as ``llama-parts``.

Text rows name no parts (only vision-language rows do), but a run that freezes part of a model is what real runs
do, and freezing is a decision that must see the same parameters under every backend. The 2-process backend tests
(tests/distributed/test_backends.py) train it from a saved folder with ``model.freeze: [layer0]``.
"""

from __future__ import annotations

import dataclasses

from finetune.registry import SUPPORTED_MODELS, register

register(dataclasses.replace(SUPPORTED_MODELS["llama"], name="llama-parts",
                             freeze_groups={"embeddings": ("model.embed_tokens",), "layer0": ("model.layers.0",)},
                             description="test: llama with freezable parts"))
