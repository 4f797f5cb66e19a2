"""train.gradient_checkpointing recomputes activations in backward: the same losses and weights as without it
(full fine-tuning and LoRA), and no deprecation or use_reentrant warning reaches the user."""

from __future__ import annotations

import warnings

import pytest

from tests.integration.conftest import final_weights, max_rel_diff, tiny_recipe

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("peft", [{"method": "none"}, {"method": "lora", "dropout": 0.0}], ids=["full", "lora"])
def test_checkpointing_changes_memory_not_math(train_recipe, peft: dict) -> None:
    from finetune.storage.metrics import read_metrics

    runs = {}
    for on in (False, True):
        recipe = tiny_recipe(name=f"gc-{on}-{peft['method']}", train={"max_steps": 3, "gradient_checkpointing": on},
                             peft=peft, eval={"metrics": ["token_accuracy"]})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs[on] = train_recipe(recipe)
        shown = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, UserWarning))
                 and ("checkpoint" in str(w.message) or "reentrant" in str(w.message))]
        assert not shown, shown
    losses = {on: [r["loss"] for r in read_metrics(run) if r["kind"] == "train"] for on, run in runs.items()}
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], rel=1e-6)
    if peft["method"] == "none":
        assert max_rel_diff(final_weights(runs[True]), final_weights(runs[False])) < 1e-5
    else:
        from safetensors.torch import load_file

        adapters = [load_file(str(runs[on] / "final" / "adapter_model.safetensors")) for on in (True, False)]
        assert adapters[0] and max_rel_diff(*adapters) < 1e-5
