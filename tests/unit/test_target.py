"""finetune.artifacts.target without a model: which run a folder lies in, the refusal of a link inside a run, and the
overrides that let a run's recipe load on this machine for eval and merge."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.artifacts.target import check_own, owning_run, portable_overrides
from finetune.errors import RunDirError
from finetune.storage import rundir


def test_the_owning_run_is_the_nearest_folder_with_a_marker(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "x"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / rundir.MARKER).write_text("{}")
    assert owning_run(run / "checkpoints" / "step-000002") == run
    assert owning_run(run) == run
    assert owning_run(tmp_path / "runs") is None


def test_a_link_inside_a_run_is_refused_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    check_own(run, run / "checkpoints" / "step-000002")  # real folders all the way down: fine
    elsewhere = tmp_path / "other-final"
    elsewhere.mkdir()
    (run / "final").symlink_to(elsewhere)
    with pytest.raises(RunDirError, match="final: a symbolic link, not a folder of the run") as info:
        check_own(run, run / "final")
    assert "\n" not in str(info.value)


def test_eval_and_merge_run_one_process_whatever_the_run_was_launched_with() -> None:
    recipe = {"model": {"type": "tiny-llama"}, "launch": {"accelerate_config": "/elsewhere/fsdp.yaml",
                                                          "num_processes": 8}}
    assert portable_overrides(recipe) == (["launch.accelerate_config=cpu", "launch.num_processes=1"], [])


def test_an_export_carries_the_recipes_chat_template_and_generate_and_eval_use_it(write_recipe, bare_tokenizer,
                                                                                  tmp_path: Path) -> None:
    """model.chat_template on a model whose tokenizer has none: the export's tokenizer folder holds the template,
    so transformers' own apply_chat_template on the exported folder renders what training rendered, and the
    tokenizer eval and generate load (load_tokenizer) renders it too: from the export, and from the recipe for a
    checkpoint (which holds no tokenizer)."""
    import transformers

    from finetune import registry
    from finetune.artifacts.target import Target, load_tokenizer
    from finetune.config import load_recipe
    from finetune.runtime.modeling import build_tokenizer, save_tokenizer

    recipe = write_recipe()
    cfg, _ = load_recipe(recipe, ["model.chat_template=chatml"])
    cfg.model.path = str(bare_tokenizer)  # a tokenizer without a template (validation wants a whole model folder)
    row = registry.recipe_row(cfg)
    trained = build_tokenizer(cfg.model, row)  # what training renders with (finetune.runtime.prepare)
    export = tmp_path / "export"
    save_tokenizer(trained, export)  # what the export writes beside the weights
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n" \
               "<|im_start|>assistant\n4<|im_end|>\n"
    for tokenizer in (trained, transformers.AutoTokenizer.from_pretrained(str(export)),
                      load_tokenizer(cfg, Target(recipe=recipe, full_model=export, row=row)),
                      load_tokenizer(cfg, Target(recipe=recipe, checkpoint=tmp_path / "step-000001", row=row))):
        assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
        assert tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True) == \
            expected.removesuffix("4<|im_end|>\n")
