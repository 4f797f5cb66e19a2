"""A custom (non-Hugging-Face) model row through ``model.plugin``: tests/plugins/tiny_custom_lm.py.

The row names a plain-torch factory, the block class FSDP wraps and the batch keys its forward takes. It trains
through the shared loop with a decreasing loss, resumes bit for bit after a SIGTERM, exports ``final/`` as a state
dict that ``finetune eval`` loads back into the factory's model, and every command or setting it cannot support is
one error line (exit 2). The 2-process FSDP2 run is tests/distributed/test_custom_model.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune import registry
from finetune.errors import ConfigError
from finetune.storage.metrics import read_metrics
from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import (
    DATA,
    cli_exit_code,
    final_weights,
    run_stopped_after,
    tiny_recipe,
    with_sections,
    write_named,
)

pytestmark = pytest.mark.integration
PLUGIN = "tests.plugins.tiny_custom_lm"


@pytest.fixture(scope="module", autouse=True)
def _plugin_rows_stay_here() -> Any:
    """The plugin's row exists only while this module runs: afterwards the table is the shipped one again (other
    tests check properties of every registered row), and the plugin is re-imported (and registers) when next used."""
    import sys

    before = dict(registry.SUPPORTED_MODELS)
    yield
    registry.SUPPORTED_MODELS.clear()
    registry.SUPPORTED_MODELS.update(before)
    sys.modules.pop(PLUGIN, None)


def custom_recipe(**sections: Any) -> dict[str, Any]:
    """tiny_recipe on the custom row: 12 steps of micro 4 x accum 2, dropout on, a checkpoint every 2 steps and an
    eval (token accuracy: the row does not generate) every 6."""
    recipe = tiny_recipe(
        model={"type": "tiny-custom", "plugin": PLUGIN, "config_overrides": {"dropout": 0.1}},
        train={"max_steps": 12}, optim={"lr": 3.0e-3},
        eval={"every_steps": 6, "metrics": ["token_accuracy"], "batch_size": 64},
        checkpoint={"every_steps": 2, "keep_last": 3},
    )
    return with_sections(recipe, **sections)


def _train_rows(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def custom_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The straight 12-step run, and the same recipe stopped by SIGTERM after step 5 (checkpoint at step 6, exit
    143) and resumed to step 12."""
    folder = tmp_path_factory.mktemp("custom")
    recipe = custom_recipe()
    assert cli_exit_code("run", str(write_named(folder, "straight", recipe))) == 0
    run_stopped_after(write_named(folder, "resumed", recipe), 5)
    resumed = folder / "resumed"
    assert (resumed / "checkpoints" / "step-000006").is_dir() and not (resumed / "final").exists()
    assert cli_exit_code("resume", str(resumed), "--trust-remote-code") == 0
    return {"straight": folder / "straight", "resumed": resumed, "folder": folder}


def test_the_plugin_row_builds_through_its_factory_and_its_output_has_logits() -> None:
    """The factory's model is seeded by build_base (same weights twice, other weights for another seed), holds the
    wrapped block class, and its bare-logits forward (and an object-with-.logits forward) both read as ``.logits``."""
    from finetune.config.schema import ModelConfig
    from finetune.runtime.modeling import build_base

    registry.load_plugin(PLUGIN)
    row = registry.get_model("tiny-custom")
    cfg = ModelConfig(type="tiny-custom", plugin=PLUGIN)
    a, b, other = build_base(cfg, row, 7), build_base(cfg, row, 7), build_base(cfg, row, 8)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert not torch.equal(a.state_dict()["head.weight"], other.state_dict()["head.weight"])
    assert sum(type(m).__name__ == "TinyBlock" for m in a.modules()) == 2
    ids = torch.randint(0, 500, (2, 9))
    mask = torch.ones_like(ids)
    a.eval()
    logits = a(input_ids=ids, attention_mask=mask).logits
    assert tuple(logits.shape) == (2, 9, 512) and torch.isfinite(logits).all()
    wrapped_row = registry.SupportedModel(**{**row.__dict__, "factory": f"{PLUGIN}:build_with_output"})
    wrapped = build_base(cfg, wrapped_row, 7).eval()
    assert torch.equal(wrapped(input_ids=ids, attention_mask=mask).logits, logits)
    unwrappable = registry.SupportedModel(**{**row.__dict__, "decoder_layer": "NoSuchBlock"})
    with pytest.raises(ConfigError, match=r"decoder_layer 'NoSuchBlock' is not a module class of the model its "
                                          r"factory builds; its classes: .*TinyBlock"):
        build_base(cfg, unwrappable, 7)
    typo = ModelConfig(type="tiny-custom", plugin=PLUGIN, config_overrides={"hiden_size": 8})
    with pytest.raises(ConfigError, match=r"^model.config_overrides: cannot load the model from its factory "
                                          rf"{PLUGIN}:build \(TypeError: .*hiden_size"):
        build_base(typo, row, 7)


def test_trains_with_a_decreasing_loss_and_resumes_bit_identically(custom_runs: dict[str, Path]) -> None:
    """12 straight steps == 6 steps, SIGTERM, `finetune resume`, 6 more: the same losses and bit-identical weights
    (dropout on, shuffle on, accumulation 2); and the loss falls."""
    straight, resumed = custom_runs["straight"], custom_runs["resumed"]
    losses = [r["loss"] for r in _train_rows(straight)]
    assert len(losses) == 12 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    evals = [r for r in read_metrics(straight) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [6, 12] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert [r["step"] for r in _train_rows(resumed)] == list(range(1, 13))
    assert [r["loss"] for r in _train_rows(resumed)] == losses
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert "resumed from step-000006: step 6" in (resumed / "train.log").read_text()


def test_final_is_a_state_dict_that_eval_loads_into_the_factory_model(custom_runs: dict[str, Path], monkeypatch,
                                                                       capsys) -> None:
    """final/ holds the state dict (no config.json), the tokenizer, the recipe and a manifest; `finetune eval` of
    the run builds the row's model through its factory, loads it and reproduces the run's last eval."""
    run = custom_runs["straight"]
    final = run / "final"
    assert not (final / "config.json").exists()
    assert {"model.safetensors", "tokenizer.json", "recipe.resolved.yaml", "manifest.json"} <= \
        {p.name for p in final.iterdir()}
    exported = final_weights(run)
    assert "blocks.1.attn.qkv.weight" in exported and sum(t.numel() for t in exported.values()) < 30_000
    code, stdout, stderr = main_exit(monkeypatch, capsys, "eval", str(run), "--json", "--trust-remote-code")
    assert code == 0, stderr
    got = json.loads(stdout)
    logged = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]
    assert got["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-6)
    assert got["eval_token_accuracy_correct"] == logged["eval_token_accuracy_correct"]
    assert got["eval_token_accuracy_total"] == logged["eval_token_accuracy_total"] > 0


@pytest.mark.parametrize("overrides,needle", [
    (["model.path=some/folder"], "model.path: tiny-custom is a custom model built by its factory"),
    (["eval.metrics=[exact_match]"], "eval.metrics: exact_match generates text, but tiny-custom does not support"),
    (["data.packing=true"], "data.packing: tiny-custom does not support packing"),
    (["train.gradient_checkpointing=true"], "train.gradient_checkpointing: tiny-custom does not support"),
    (["peft.method=lora"], "peft.method: lora is not supported for tiny-custom"),
    (["model.attn_implementation=sdpa"], "model.attn_implementation: tiny-custom is a custom model"),
    (["task=dpo", "data.format=preference", f"data.train={DATA / 'reverse_pref_train.jsonl'}",
      f"data.eval={DATA / 'reverse_pref_eval.jsonl'}", "eval.metrics=[preference_accuracy]"],
     "lacks the preference capability"),
])
def test_what_the_row_does_not_claim_is_one_line(tmp_path: Path, monkeypatch, capsys, overrides: list[str],
                                                 needle: str) -> None:
    """Each setting the custom row cannot support is refused before anything runs, in one line per problem."""
    recipe = write_named(tmp_path, "refused", custom_recipe())
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe), *overrides)
    assert_user_error(code, out, err, needle)
    assert not (tmp_path / "refused").exists()


@pytest.fixture
def broken_rows() -> Any:
    """Two custom rows whose factories cannot be used: a module that does not exist, a name that is no function."""
    registry.load_plugin(PLUGIN)
    base = registry.get_model("tiny-custom")
    names = {"custom-missing": "tests.plugins.no_such_module:build", "custom-not-callable": f"{PLUGIN}:DEFAULT_CONFIG"}
    for name, factory in names.items():
        registry.register(registry.SupportedModel(**{**base.__dict__, "name": name, "factory": factory}))
    yield
    for name in names:
        registry.SUPPORTED_MODELS.pop(name, None)


@pytest.mark.parametrize("model_type,needle", [
    ("custom-missing", "model.plugin: SupportedModel 'custom-missing' factory "
                       "'tests.plugins.no_such_module:build': cannot import 'tests.plugins.no_such_module'"),
    ("custom-not-callable", "model.plugin: SupportedModel 'custom-not-callable' factory "
                            f"'{PLUGIN}:DEFAULT_CONFIG': {PLUGIN}.DEFAULT_CONFIG is not callable"),
])
def test_a_factory_that_cannot_be_used_is_one_line(tmp_path: Path, monkeypatch, capsys, broken_rows: Any,
                                                   model_type: str, needle: str) -> None:
    recipe = write_named(tmp_path, "broken", custom_recipe(model={"type": model_type}))
    code, out, err = main_exit(monkeypatch, capsys, "config", str(recipe))
    lines = assert_user_error(code, out, err, needle)
    assert len(lines) == 1


def _refused_after_progress(code: int, out: str, err: str, needle: str) -> None:
    """Exit 2, no traceback, and the one error line last (after the command's own progress lines on stderr)."""
    assert code == 2 and "Traceback" not in err, (code, err)
    errors = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0] and err.strip().splitlines()[-1] == errors[0], err


def test_commands_that_need_a_hugging_face_model_refuse_in_one_line(custom_runs: dict[str, Path], tmp_path: Path,
                                                                    monkeypatch, capsys) -> None:
    """export and eval of a checkpoint, generate, merge and the memory plan refuse a custom run (exit 2) and
    write nothing."""
    run, ckpt = custom_runs["straight"], custom_runs["straight"] / "checkpoints" / "step-000012"
    out = tmp_path / "exported"
    _refused_after_progress(*main_exit(monkeypatch, capsys, "export", str(run), "-o", str(out), "--trust-remote-code"),
                            "is a custom model")
    assert not out.exists() and not list(tmp_path.glob(".exported*"))
    _refused_after_progress(*main_exit(monkeypatch, capsys, "eval", str(ckpt), "--trust-remote-code"),
                            "is a custom model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc"}) + "\n")
    assert_user_error(*main_exit(monkeypatch, capsys, "generate", str(run), str(prompts), "-o",
                                 str(tmp_path / "out.jsonl"), "--trust-remote-code"), "does not generate text")
    assert not (tmp_path / "out.jsonl").exists()
    assert_user_error(*main_exit(monkeypatch, capsys, "merge", str(run), "-o", str(tmp_path / "merged"),
                                 "--trust-remote-code"), "not a LoRA run")
    recipe = write_named(tmp_path, "planned", custom_recipe())
    assert_user_error(*main_exit(monkeypatch, capsys, "plan", str(recipe)), "without a Hugging Face config")
