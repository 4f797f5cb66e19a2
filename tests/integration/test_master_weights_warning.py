"""A run that will update 16-bit weights with no fp32 master copy says so at its start (train.log and stderr);
tests/unit/test_precision.py checks when the line is (not) due."""

from __future__ import annotations

from tests.integration.conftest import tiny_recipe


def test_16_bit_weights_without_master_copy_are_a_warning_line(train_recipe, capsys) -> None:
    run = train_recipe(tiny_recipe(model={"type": "tiny-llama", "dtype": "bfloat16"}, data={"eval": None},
                                   train={"max_steps": 1}, scheduler={"warmup_steps": 0},
                                   checkpoint={"every_steps": None, "save_final": False}))
    line = "warning: model.dtype=bfloat16: "
    assert line in (run / "train.log").read_text()
    assert line in capsys.readouterr().err
