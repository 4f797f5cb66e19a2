"""finetune.config.validate: a composed recipe checked against the schema and the rules across keys, every error
message; derived values, the resolved recipe's round trip, and every shipped recipe and preset.

Pure config code: no torch, no training. Every shipped recipe and preset is validated here.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

from finetune import registry
from finetune.config import compose, load_recipe, load_resolved, validate
from finetune.errors import ConfigError
from finetune.storage.rundir import write_resolved
from tests.config_helpers import RECIPE_TEXT, errors_of, one_error
from tests.recipe_files import write_recipe_file

REPO = Path(__file__).resolve().parents[2]
SHIPPED_RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
PRESETS = sorted((REPO / "recipes" / "presets").glob("*.yaml"))

pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


# --- validation ---------------------------------------------------------------------------------------------------


def test_unknown_key_suggests_the_sibling_with_file_and_line(write_recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_recipe(RECIPE_TEXT.replace("  max_steps: 4", "  max_stepz: 4\n  max_steps: 4"))
    assert one_error(path) == "train.max_stepz: unknown key; did you mean train.max_steps? (set at recipe.yaml:7)"


def test_unknown_section_in_a_file_names_its_line(write_recipe):
    path = write_recipe(RECIPE_TEXT + "optimizer:\n  lr: 0.1\n")
    assert one_error(path) == "optimizer: unknown key; did you mean optim? (set at recipe.yaml:11)"

@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("train.lr=0.1", "optim.lr"),  # the same leaf in another section
        ("optimizer={lr: 0.1}", "optim"),
        ("logging.wandb.projct=x", "logging.wandb.project"),
        ("model.tpye=llama", "model.type"),
    ],
)
def test_unknown_key_did_you_mean(write_recipe, override, suggestion):
    key = override.split("=")[0]
    message = one_error(write_recipe(), [override])
    assert message.startswith(f"{key}: unknown key; did you mean {suggestion}?")
    assert f"(set at override {override})" in message


def test_unknown_key_without_a_close_match_has_no_suggestion(write_recipe):
    assert one_error(write_recipe(), ["train.zzzzqqq=1"]).startswith("train.zzzzqqq: unknown key (set at")


def test_every_schema_error_is_reported_at_once_one_line_each(write_recipe):
    lines = errors_of(write_recipe(), ["train.max_stepz=5", "optim.lr=fast", "data.formt=chat", "scheduler.name=step"])
    assert len(lines) == 4, lines
    assert sum(line.startswith("train.max_stepz: unknown key") for line in lines) == 1
    assert sum(line.startswith("data.formt: unknown key; did you mean data.format?") for line in lines) == 1
    assert any(line.startswith("optim.lr:") and "'fast'" in line for line in lines)
    assert any(line.startswith("scheduler.name:") and "'step'" in line for line in lines)


def test_every_semantic_error_is_reported_at_once(write_recipe):
    lines = errors_of(write_recipe(), ["data.train=missing.jsonl", "eval.metrics=[accuracy]",
                                       "launch.accelerate_config=nope"])
    assert len(lines) == 4, lines  # + eval metrics without data.eval


@pytest.mark.parametrize(
    ("override", "key", "shown"),
    [
        ("train.max_steps=abc", "train.max_steps", "'abc'"),
        ("train.micro_batch_size=0", "train.micro_batch_size", "0"),
        ("model.dtype=float64", "model.dtype", "'float64'"),
        ("data.shuffle=maybe", "data.shuffle", "'maybe'"),
        ("optim.betas=[0.9]", "optim.betas", ""),
    ],
)
def test_wrong_type_names_the_key_and_value(write_recipe, override, key, shown):
    message = one_error(write_recipe(), [override])
    assert message.startswith(f"{key}")
    assert shown in message


def test_missing_required_section_is_named(write_recipe, minimal_recipe):
    del minimal_recipe["data"]
    assert one_error(write_recipe(minimal_recipe)) == "data: required key is missing"


def test_indivisible_global_batch_names_the_numbers_and_suggests_working_ones(write_recipe):
    message = one_error(write_recipe(), ["train.global_batch_size=30", "train.micro_batch_size=4",
                                         "launch.num_processes=2", "launch.accelerate_config=ddp"])
    assert "global_batch_size=30" in message and "micro_batch_size=4" in message and "2 process" in message
    assert "24 or 32" in message and "1, 3, 5, 15" in message
    for fix in (["train.global_batch_size=24"], ["train.global_batch_size=32"], ["train.micro_batch_size=5"]):
        cfg, _ = load_recipe(write_recipe(), ["train.global_batch_size=30", "train.micro_batch_size=4",
                                              "launch.num_processes=2", "launch.accelerate_config=ddp", *fix])
        assert cfg.train.global_batch_size == cfg.train.micro_batch_size * cfg.grad_accum * 2


@pytest.mark.parametrize("overrides", [["train.epochs=1"], ["train.max_steps=null"]])
def test_exactly_one_of_max_steps_and_epochs(write_recipe, overrides):
    message = one_error(write_recipe(), overrides)
    assert "train.max_steps" in message and "train.epochs" in message


def test_epochs_alone_is_fine(write_recipe):
    cfg, _ = load_recipe(write_recipe(), ["train.max_steps=null", "train.epochs=0.5"])
    assert cfg.train.epochs == 0.5 and cfg.train.max_steps is None


def test_unknown_model_type_did_you_mean(write_recipe):
    message = one_error(write_recipe(), ["model.type=tiny-lama"])
    assert message.startswith("model.type: unknown model type 'tiny-lama'; did you mean tiny-llama")


def test_metric_not_allowed_for_the_task(write_recipe):
    message = one_error(write_recipe(), ["data.eval=eval.jsonl", "eval.metrics=[accuracy]"])
    assert message.startswith("eval.metrics: 'accuracy' is not a causal_lm metric")
    assert "exact_match" in message and "token_accuracy" in message


def test_data_format_must_fit_the_task(write_recipe):
    message = one_error(write_recipe(), ["data.format=classification"])
    assert message.startswith("data.format: 'classification' does not fit tiny-llama")


def test_missing_data_file_is_an_error(write_recipe):
    message = one_error(write_recipe(), ["data.train=missing.jsonl"])
    assert message.startswith("data.train: file not found") and "missing.jsonl" in message


def test_data_sources_beyond_one_file_are_checked_before_anything_loads(write_recipe, tmp_path):
    """A glob must match a file, a missing compressed file is not found, a file or glob is the one split train
    (sliced as you like), and a folder's subset and splits are its own (checked when it is read)."""
    recipe = write_recipe()
    (tmp_path / "repo").mkdir()
    assert one_error(recipe, ["data.train=shards/part-*.jsonl"]) == \
        f"data.train: no file matches {tmp_path / 'shards' / 'part-*.jsonl'}"
    assert one_error(recipe, ["data.train=missing.jsonl.gz"]).startswith("data.train: file not found")
    split = one_error(recipe, ["data.train=[{path: train.jsonl, split: validation}]"])
    assert split.startswith("data.train[0].split: ") and "is a local file, which is one split, train" in split
    subset = one_error(recipe, ["data.train=[{path: '*.jsonl', subset: x}]"])
    assert subset.startswith("data.train[0].subset: ") and "is a glob of files, which has no subsets" in subset
    for valid in (["data.train=[{path: train.jsonl, split: 'train[:50%]'}]"], ["data.train=*.jsonl"],
                  ["data.train=[{path: repo, subset: en, split: 'validation[:10]'}]"]):
        cfg, _ = load_recipe(recipe, valid)
        assert cfg.data.train_sources()[0].path.startswith(str(tmp_path)), valid
    sub = tmp_path / "sub"  # a glob in a recipe resolves against the recipe's folder, not the working one
    nested = write_recipe(RECIPE_TEXT.replace("train: train.jsonl", "train: 'part-*'"), folder=sub)
    (sub / "part-1.jsonl").write_text((sub / "train.jsonl").read_text())
    assert load_recipe(nested)[0].data.train == str(sub / "part-*")


def test_a_chat_template_is_a_known_name_or_an_existing_file(write_recipe, tmp_path):
    """One line each: an unknown name lists the names; a missing file names the path (resolved against the
    recipe's folder); the default is null (the tokenizer's own template)."""
    recipe = write_recipe()
    assert load_recipe(recipe)[0].model.chat_template is None
    message = one_error(recipe, ["model.chat_template=chatlm"])
    assert message.startswith("model.chat_template") and "'chatlm' is not a named chat template" in message
    assert "use one of chatml" in message
    message = one_error(recipe, ["model.chat_template=gone.jinja"])
    assert message == f"model.chat_template: file not found: {Path.cwd() / 'gone.jinja'}"
    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_recipe(recipe, [f"model.chat_template={tmp_path / 'mine.jinja'}"])[0].model.chat_template == \
        str(tmp_path / "mine.jinja")


def test_a_stored_recipe_may_name_a_chat_template_file_that_is_gone(write_recipe, tmp_path):
    """A recipe read to open what a run left behind (train_files=False: eval, export, generate) is not refused for
    a template file removed since: an export's tokenizer carries its template (a checkpoint's says so on load)."""
    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    composed = compose(write_recipe(), [f"model.chat_template={tmp_path / 'mine.jinja'}"])
    (tmp_path / "mine.jinja").unlink()
    assert validate(composed, train_files=False).model.chat_template == str(tmp_path / "mine.jinja")
    with pytest.raises(ConfigError, match=r"model\.chat_template: file not found"):
        validate(composed)


def test_eval_metrics_need_an_eval_set(write_recipe):
    assert one_error(write_recipe(), ["eval.metrics=[exact_match]"]).startswith("data.eval:")
    assert one_error(write_recipe(), ["eval.every_steps=1"]).startswith("data.eval:")


def test_unknown_accelerate_config_is_an_error(write_recipe):
    message = one_error(write_recipe(), ["launch.accelerate_config=no_such_backend"])
    assert message.startswith("launch.accelerate_config: 'no_such_backend'")


def test_accelerate_config_may_be_a_path(write_recipe, tmp_path):
    (tmp_path / "my_accel.yaml").write_text("distributed_type: 'NO'\n")
    cfg, _ = load_recipe(write_recipe(), [f"launch.accelerate_config={tmp_path / 'my_accel.yaml'}"])
    assert cfg.launch.accelerate_config == str(tmp_path / "my_accel.yaml")


def test_model_path_is_required_unless_the_row_is_a_debug_build(write_recipe):
    assert one_error(write_recipe(), ["model.type=llama"]).startswith("model.path: required for model type llama")
    cfg, _ = load_recipe(write_recipe(), ["model.type=llama", "model.path=some-org/some-model"])
    assert cfg.model.path == "some-org/some-model"


def test_unsupported_capability_is_an_error(write_recipe):
    lines = errors_of(write_recipe(), ["model.type=gpt2", "model.path=x/y", "data.packing=true"])
    assert any(line.startswith("data.packing: gpt2 does not support packing") for line in lines), lines


PLUGIN_MODULE = "finetune_test_plugin_rows"
PLUGIN_SOURCE = """
import dataclasses
from finetune import registry

registry.register(dataclasses.replace(registry.SUPPORTED_MODELS["tiny-llama"], name="my-tiny",
                                      description="a plugin row"))
"""


@pytest.fixture
def plugin_on_path(tmp_path, monkeypatch):
    """A plugin module on sys.path that registers the row ``my-tiny``; the row is removed afterwards."""
    (tmp_path / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield PLUGIN_MODULE
    registry.SUPPORTED_MODELS.pop("my-tiny", None)
    sys.modules.pop(PLUGIN_MODULE, None)


def test_plugin_registers_a_model_type(write_recipe, plugin_on_path):
    assert one_error(write_recipe(), ["model.type=my-tiny"]).startswith("model.type: unknown model type 'my-tiny'")
    cfg, _ = load_recipe(write_recipe(), ["model.type=my-tiny", f"model.plugin={plugin_on_path}"])
    assert cfg.model.type == "my-tiny"
    assert registry.get_model("my-tiny").description == "a plugin row"


def test_plugin_that_cannot_be_imported_is_a_config_error(write_recipe):
    message = one_error(write_recipe(), ["model.plugin=no_such_module_xyz"])
    assert message.startswith("model.plugin: cannot import 'no_such_module_xyz'")
    assert "no_such_module_xyz" not in sys.modules


def test_a_left_out_model_type_is_read_from_the_folder_and_recorded(write_recipe, tmp_path, minimal_recipe):
    """model.type null: the row whose model_types list config.json's model_type (llama, not the debug tiny-llama);
    the resolved recipe names it, so every later command reads the same row."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")  # validation only looks for weight files
    minimal_recipe["model"] = {"path": "model"}
    cfg, composed = load_recipe(write_recipe(minimal_recipe))
    assert cfg.model.type == "llama"
    assert composed.provenance["model.type"] == f"model_type of {tmp_path / 'model'}'s config.json"  # --provenance
    (tmp_path / "run").mkdir()
    assert load_resolved(write_resolved(cfg, tmp_path / "run")).model.type == "llama"


@pytest.mark.parametrize(("path", "expected"), [
    (None, "model.type: not set, and model.path is null (nothing to read the model type from); set model.type to a "
           "row of `finetune models` (tiny-llama builds a debug model), or model.path"),
    ("weights", "model.path: weights has no config.json to read the model type from; give a Hugging Face model "
                "folder, or set model.type (a row of `finetune models`)"),
])
def test_a_model_type_that_cannot_be_found_is_one_line(write_recipe, tmp_path, minimal_recipe, path, expected):
    (tmp_path / "weights").mkdir()
    minimal_recipe["model"] = {"path": path}
    assert one_error(write_recipe(minimal_recipe)).replace(f"{tmp_path}/", "") == expected  # relative to the recipe


def test_a_preset_the_row_does_not_name_is_one_line(write_recipe, monkeypatch):
    """A row may leave a preset out (a derived row whose layers have no attention); asking for it is refused before
    anything is built, naming the presets it has."""
    row = registry.SUPPORTED_MODELS["tiny-llama"]
    monkeypatch.setitem(registry.SUPPORTED_MODELS, "no-attn", dataclasses.replace(
        row, name="no-attn", lora_targets={"attn_mlp": ("up_proj",), "all_linear": ("up_proj",)}))
    assert one_error(write_recipe(), ["model.type=no-attn", "peft.method=lora", "peft.preset=attn"]) == (
        "peft.preset: no-attn names no modules for preset attn; use peft.preset=attn_mlp or peft.preset=all_linear "
        "or peft.target_modules")
    load_recipe(write_recipe(), ["model.type=no-attn", "peft.method=lora", "peft.target_modules=[up_proj]"])


# --- derived values, round trip -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("procs", "accum"), [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_grad_accum_is_derived(write_recipe, procs, accum):
    cfg, _ = load_recipe(write_recipe(), ["train.global_batch_size=32", "train.micro_batch_size=4",
                                          f"launch.num_processes={procs}", "launch.accelerate_config=ddp"])
    assert cfg.grad_accum == accum


def test_output_dir_defaults_to_runs_name_absolute(write_recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = load_recipe(write_recipe())
    assert cfg.output_dir == str((tmp_path / "runs" / "tiny").resolve())
    cfg, _ = load_recipe(write_recipe(), ["output_dir=elsewhere/run1"])
    assert cfg.output_dir == str((tmp_path / "elsewhere" / "run1").resolve())


def test_resolved_recipe_round_trips(write_recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = load_recipe(write_recipe(), ["optim.lr=1e-5", "data.eval=eval.jsonl", "eval.metrics=[exact_match]"])
    (tmp_path / "run").mkdir()
    resolved = write_resolved(cfg, tmp_path / "run")
    monkeypatch.chdir(REPO)  # the resolved recipe holds absolute paths: any cwd works
    assert load_resolved(resolved) == cfg


def test_a_stored_recipe_without_a_later_key_reads_as_its_run_trained(write_recipe, tmp_path, monkeypatch):
    """A key added after runs were trained without it (data.add_bos, train.dropout) is the default in a recipe a
    user writes, and the value the run trained with in a recipe finetune wrote before it existed (bos before every
    chat; a DPO run's dropout on); a stored value is kept."""
    import yaml

    from finetune.artifacts.target import recipe_of
    from finetune.config.compose import compose_stored
    from finetune.config.schema import STORED_DEFAULTS

    monkeypatch.chdir(tmp_path)
    assert STORED_DEFAULTS == {"data.add_bos": "always", "train.dropout": True}
    cfg, _ = load_recipe(write_recipe(), ["task=dpo", "data.format=preference"])
    assert (cfg.data.add_bos, cfg.train.dropout) == ("auto", False)
    (tmp_path / "run").mkdir()
    resolved = write_resolved(cfg, tmp_path / "run")
    assert load_resolved(resolved).data.add_bos == "auto"  # written now: the key is there
    data = yaml.safe_load(resolved.read_text())
    del data["data"]["add_bos"], data["train"]["dropout"]
    write_recipe_file(resolved, data)
    assert (load_resolved(resolved).data.add_bos, load_resolved(resolved).train.dropout) == ("always", True)
    assert recipe_of(resolved, [], False).data.add_bos == "always"  # what eval, export and generate open
    assert compose_stored(resolved).provenance["data.add_bos"] == "stored recipe written before this key existed"
    assert validate(compose_stored(resolved, ["data.add_bos=auto"])).data.add_bos == "auto"
    assert validate(compose(resolved)).data.add_bos == "auto"  # the same file given as a recipe: today's default


# --- shipped recipes and presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", SHIPPED_RECIPES, ids=[p.name for p in SHIPPED_RECIPES])
def test_shipped_recipe_validates_from_any_cwd(recipe, tmp_path, monkeypatch):
    """From an empty folder, once the runs its header's commands make exist (a distillation reads the quickstart's
    run as its teacher and a weak run as its student: each stands here as a model folder under runs/)."""
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load(recipe.read_text())
    for value in ((data.get("model") or {}).get("path"), (data.get("distill") or {}).get("teacher")):
        if isinstance(value, str) and value.startswith("runs/"):
            folder = tmp_path / value
            folder.mkdir(parents=True)
            (folder / "config.json").write_text('{"model_type": "llama"}')
            (folder / "model.safetensors").write_bytes(b"")
    cfg, composed = load_recipe(recipe)
    assert cfg.name
    # runs/<name> follows name: a recipe that extends this one and renames it must not train into this one's folder
    assert "output_dir" not in composed.data and cfg.output_dir == str(tmp_path / "runs" / cfg.name)
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# finetune "), "a recipe's header comment is the command that runs it"


def test_quickstart_is_shipped():
    assert REPO / "recipes" / "quickstart.yaml" in SHIPPED_RECIPES


def test_every_preset_composes_as_an_extends_base(write_recipe, tmp_path):
    """Each recipes/presets/*.yaml layered on quickstart still validates (no presets yet: nothing to check)."""
    for preset in PRESETS:
        recipe = write_recipe({"extends": [str(REPO / "recipes" / "quickstart.yaml"), str(preset)]},
                              f"with_{preset.stem}.yaml")
        composed = compose(recipe)
        assert composed.files[-2] == preset.resolve()
        validate(composed)


def test_schema_errors_and_other_problems_are_reported_together(write_recipe):
    """A typo does not hide an unknown model type or a missing data file in the same recipe."""
    with pytest.raises(ConfigError) as info:
        load_recipe(write_recipe(), ["train.max_stepz=5", "model.type=lama", "data.train=nope.jsonl"])
    lines = str(info.value).splitlines()
    assert any(line.startswith("train.max_stepz: unknown key") for line in lines)
    assert any("unknown model type 'lama'" in line for line in lines)
    assert any(line.startswith("data.train: file not found") for line in lines)
