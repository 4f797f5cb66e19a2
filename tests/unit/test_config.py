"""Recipe composition and validation: extends, provenance, typed overrides, path resolution, every error message.

Pure config code: no torch, no training. Every shipped recipe and preset is validated here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from finetune import registry
from finetune.config import compose, load_recipe, load_resolved, validate
from finetune.config.compose import parse_override
from finetune.errors import ConfigError
from finetune.storage.rundir import write_resolved
from tests.recipe_files import write_recipe_file

REPO = Path(__file__).resolve().parents[2]
SHIPPED_RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
PRESETS = sorted((REPO / "recipes" / "presets").glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def errors_of(recipe: Path, overrides: list[str] | None = None) -> list[str]:
    """The lines of the ConfigError that composing + validating ``recipe`` raises."""
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, overrides)
    return str(info.value).splitlines()


def one_error(recipe: Path, overrides: list[str] | None = None) -> str:
    lines = errors_of(recipe, overrides)
    assert len(lines) == 1, lines
    return lines[0]


# --- extends ----------------------------------------------------------------------------------------------------


def test_extends_single_path_is_relative_to_the_recipe_not_the_cwd(write_recipe, minimal_recipe, tmp_path,
                                                                   monkeypatch):
    write_recipe({"optim": {"lr": 0.5, "weight_decay": 0.1}, "train": {"seed": 7}}, "base.yaml", tmp_path / "bases")
    child = write_recipe({"extends": "../bases/base.yaml", **minimal_recipe, "optim": {"lr": 0.25}},
                         "child.yaml", tmp_path / "recipes")
    monkeypatch.chdir(tmp_path / "bases")  # a cwd where a cwd-relative lookup would fail
    cfg, composed = load_recipe(child)
    assert cfg.optim.lr == 0.25  # the recipe overrides its base
    assert cfg.optim.weight_decay == 0.1  # sections merge deeply
    assert cfg.train.seed == 7 and cfg.train.max_steps == 2
    assert "extends" not in composed.data
    assert composed.files == [(tmp_path / "bases" / "base.yaml").resolve(), child.resolve()]


def test_extends_list_later_files_win_dicts_merge_lists_replace(write_recipe, minimal_recipe):
    write_recipe({"optim": {"lr": 0.1, "weight_decay": 0.5}, "eval": {"metrics": ["exact_match", "token_accuracy"]},
                  "model": {"type": "gpt2", "dtype": "bfloat16",
                            "config_overrides": {"hidden_size": 32, "num_attention_heads": 2}}}, "a.yaml")
    write_recipe({"optim": {"lr": 0.2}, "eval": {"metrics": ["exact_match"]}, "train": {"seed": 1}}, "b.yaml")
    minimal_recipe["model"]["config_overrides"] = {"hidden_size": 64}
    minimal_recipe["data"]["eval"] = "eval.jsonl"
    minimal_recipe["train"]["seed"] = 2
    child = write_recipe({"extends": ["a.yaml", "b.yaml"], **minimal_recipe}, "child.yaml")
    cfg, _ = load_recipe(child)
    assert cfg.optim.lr == 0.2  # b.yaml overrides a.yaml
    assert cfg.optim.weight_decay == 0.5  # a.yaml's other keys survive
    assert cfg.eval.metrics == ["exact_match"]  # lists replace, never concatenate
    assert cfg.train.seed == 2  # the recipe itself overrides both bases
    assert cfg.model.type == "tiny-llama" and cfg.model.dtype == "bfloat16"
    assert cfg.model.config_overrides == {"hidden_size": 64, "num_attention_heads": 2}  # nested dicts merge


def test_extends_falls_back_to_the_shipped_recipes_folder(write_recipe, minimal_recipe, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    write_recipe({"optim": {"lr": 0.01}}, "mypreset.yaml", shipped / "presets")
    monkeypatch.setenv("FINETUNE_RECIPES_DIR", str(shipped))
    user = write_recipe({"extends": "presets/mypreset.yaml", **minimal_recipe}, "r.yaml", tmp_path / "user")
    cfg, composed = load_recipe(user)
    assert cfg.optim.lr == 0.01
    assert composed.files[0] == (shipped / "presets" / "mypreset.yaml").resolve()
    # a file next to the recipe wins over the shipped one
    write_recipe({"optim": {"lr": 0.02}}, "mypreset.yaml", tmp_path / "user" / "presets")
    assert load_recipe(user)[0].optim.lr == 0.02


@pytest.mark.parametrize("base", ["quickstart.yaml", "quickstart"])
def test_the_readme_editor_example_trains_into_runs_of_its_own_name(write_recipe, tmp_path, base):
    """README, Editor support: ``name: mine`` over ``extends: [quickstart.yaml]`` (or the bare name, as
    ``finetune run quickstart`` takes it) is the shipped quickstart renamed, and it trains into runs/mine: no
    shipped recipe pins output_dir, and a bare name finds the same file as the command line does."""
    from finetune.config.resources import resolve_recipe

    mine = write_recipe(f"# yaml-language-server: $schema=recipe.schema.json\nname: mine\nextends: [{base}]\n",
                        "mine.yaml", tmp_path / "my-recipes")
    cfg, composed = load_recipe(mine)
    assert cfg.name == "mine" and cfg.output_dir == str(tmp_path / "runs" / "mine")
    assert composed.files[0] == resolve_recipe("quickstart").resolve() == (REPO / "recipes" / "quickstart.yaml")
    shipped, _ = load_recipe(REPO / "recipes" / "quickstart.yaml")
    assert cfg.model_dump() == {**shipped.model_dump(), "name": "mine", "output_dir": cfg.output_dir}


def test_a_folder_of_that_name_does_not_hide_a_shipped_recipe_named_in_extends(write_recipe, tmp_path):
    (tmp_path / "quickstart").mkdir()  # as on the command line, where `finetune run quickstart` ignores a folder
    cfg, _ = load_recipe(write_recipe("name: mine\nextends: quickstart\n", "mine.yaml"))
    assert cfg.train.max_steps == load_recipe(REPO / "recipes" / "quickstart.yaml")[0].train.max_steps


def test_an_unknown_name_in_extends_lists_the_shipped_recipes(write_recipe):
    message = one_error(write_recipe("name: mine\nextends: [quickstrat]\n", "mine.yaml"))
    assert "extends: 'quickstrat' not found" in message and "no shipped recipe of that name" in message
    assert "quickstart" in message.split("shipped:", 1)[1]


def test_extends_cycle_is_an_error_naming_the_chain(write_recipe, tmp_path):
    write_recipe({"extends": "b.yaml", "name": "a"}, "a.yaml")
    write_recipe({"extends": ["c.yaml"], "name": "b"}, "b.yaml")
    write_recipe({"extends": "a.yaml", "name": "c"}, "c.yaml")
    message = one_error(tmp_path / "a.yaml")
    assert "cycle" in message
    names = [Path(part.strip()).name for part in message.split("cycle", 1)[1].split("->")]
    assert names == ["a.yaml", "b.yaml", "c.yaml", "a.yaml"]


def test_extends_self_is_a_cycle(write_recipe, tmp_path):
    assert "cycle" in one_error(write_recipe({"extends": "self.yaml"}, "self.yaml"))


@pytest.mark.parametrize("target", ["nope.yaml", "presets/nope.yaml"])
def test_missing_extends_target_is_an_error(write_recipe, minimal_recipe, tmp_path, monkeypatch, target):
    monkeypatch.setenv("FINETUNE_RECIPES_DIR", str(tmp_path / "shipped"))
    message = one_error(write_recipe({"extends": target, **minimal_recipe}))
    assert "extends" in message and target in message and "not found" in message


@pytest.mark.parametrize("extends", [3, {"a": "b.yaml"}, [None]])
def test_extends_must_be_paths(write_recipe, minimal_recipe, extends):
    assert "extends" in one_error(write_recipe({"extends": extends, **minimal_recipe}))


# --- provenance ---------------------------------------------------------------------------------------------------

RECIPE_TEXT = """\
# a comment line
name: prov
model:
  type: tiny-llama
data: {format: alpaca, train: train.jsonl}
train:
  max_steps: 4
  micro_batch_size: 2
  global_batch_size: 4
"""


def test_provenance_names_file_and_line_of_each_leaf(write_recipe, tmp_path, monkeypatch):
    write_recipe("optim:\n  lr: 0.5\n  weight_decay: 0.1\n", "base.yaml")
    path = write_recipe("extends: base.yaml\n" + RECIPE_TEXT)
    monkeypatch.chdir(tmp_path)
    composed = compose(path, ["train.max_steps=5", "optim.lr=0.01"])
    prov = composed.provenance
    assert prov["name"] == "recipe.yaml:3"
    assert prov["model.type"] == "recipe.yaml:5"
    assert prov["data.format"] == prov["data.train"] == "recipe.yaml:6"  # flow mappings: the key's line
    assert prov["train.micro_batch_size"] == "recipe.yaml:9"
    assert prov["optim.weight_decay"] == "base.yaml:3"  # inherited keys name the base file
    assert prov["train.max_steps"] == "override train.max_steps=5"
    assert prov["optim.lr"] == "override optim.lr=0.01"
    for unset in ("optim.eps", "train.seed", "launch.accelerate_config", "model.path"):
        assert unset not in prov  # unset keys are defaults (the CLI renders them as "default")
    assert "extends" not in prov and "model" not in prov  # only leaves


def test_provenance_outside_cwd_is_an_absolute_path(write_recipe, tmp_path, monkeypatch):
    path = write_recipe(RECIPE_TEXT, folder=tmp_path / "r")
    monkeypatch.chdir(tmp_path)
    assert compose(path).provenance["name"] == "r/recipe.yaml:2"
    monkeypatch.chdir(REPO)
    assert compose(path).provenance["name"] == f"{path.resolve()}:2"


def test_dict_override_replaces_the_section_and_its_provenance(write_recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    composed = compose(write_recipe(RECIPE_TEXT), ["train={epochs: 1, micro_batch_size: 1}"])
    assert composed.data["train"] == {"epochs": 1, "micro_batch_size": 1}
    assert composed.provenance["train.epochs"] == "override train={epochs: 1, micro_batch_size: 1}"
    assert "train.max_steps" not in composed.provenance  # no stale file:line for a key that is gone


# --- overrides ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "key", "value"),
    [
        ("train.max_steps=50", "train.max_steps", 50),
        ("name=123", "name", "123"),  # the schema types name as str
        ("name=true", "name", "true"),
        ("output_dir=null", "output_dir", None),
        ("eval.metrics=[exact_match,token_accuracy]", "eval.metrics", ["exact_match", "token_accuracy"]),
        ("model.path=null", "model.path", None),
        ("model.path=~", "model.path", None),
        ("optim.lr=1e-3", "optim.lr", 1e-3),
        ("optim.lr=3.0e-4", "optim.lr", 3e-4),
        ("train.mixed_precision=no", "train.mixed_precision", "no"),  # a Literal of strings: not YAML's False
        ("data.shuffle=false", "data.shuffle", False),
        ("model.config_overrides={hidden_size: 32}", "model.config_overrides", {"hidden_size": 32}),
        ("model.config_overrides.rope_theta=1e6", "model.config_overrides.rope_theta", 1e6),
        (" train.seed =3", "train.seed", 3),
        ("data.train=a=b.jsonl", "data.train", "a=b.jsonl"),  # only the first '=' splits
    ],
)
def test_overrides_are_typed_by_the_schema(item, key, value):
    parsed_key, parsed = parse_override(item)
    assert parsed_key == key
    assert parsed == value and type(parsed) is type(value)


def test_typed_overrides_reach_the_validated_recipe(write_recipe):
    cfg, _ = load_recipe(write_recipe(), ["name=123", "optim.lr=1e-3", "train.max_steps=50", "data.eval=eval.jsonl",
                                          "eval.metrics=[exact_match,token_accuracy]", "train.mixed_precision=no"])
    assert cfg.name == "123"
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 50
    assert cfg.eval.metrics == ["exact_match", "token_accuracy"]
    assert cfg.train.mixed_precision == "no"


def test_exponent_floats_in_recipe_files_are_floats(write_recipe, minimal_recipe):
    write_recipe("optim: {lr: 1e-3}\nmodel: {config_overrides: {rope_theta: 5e5}}\n", "base.yaml")
    cfg, _ = load_recipe(write_recipe({"extends": "base.yaml", **minimal_recipe}))
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.model.config_overrides["rope_theta"] == 5e5 and isinstance(cfg.model.config_overrides["rope_theta"],
                                                                         float)


@pytest.mark.parametrize("item", ["train.max_steps", "=3", "a..b=1", ".a=1", "a.=1", ""])
def test_malformed_override_is_a_config_error(item):
    with pytest.raises(ConfigError, match=r"expected key\.path=value"):
        parse_override(item)


def test_override_with_invalid_yaml_value_is_a_config_error():
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_override("eval.metrics=[exact_match,")


def test_override_below_a_scalar_is_a_config_error(write_recipe):
    assert "not a section" in one_error(write_recipe(), ["name.first=x"])


# --- paths --------------------------------------------------------------------------------------------------------


def test_data_paths_resolve_against_the_file_that_set_them(write_recipe, minimal_recipe, tmp_path, monkeypatch):
    base_dir, recipe_dir = tmp_path / "base", tmp_path / "recipes"
    write_recipe({"data": {"eval": "eval.jsonl"}}, "base.yaml", base_dir)
    recipe = write_recipe({"extends": "../base/base.yaml", **minimal_recipe}, folder=recipe_dir)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg, _ = load_recipe(recipe)
    assert cfg.data.train == str((recipe_dir / "train.jsonl").resolve())
    assert cfg.data.eval == str((base_dir / "eval.jsonl").resolve())


def test_override_paths_resolve_against_the_cwd(write_recipe, tmp_path, monkeypatch):
    recipe = write_recipe(folder=tmp_path / "recipes")
    cwd = tmp_path / "cwd"
    write_recipe("", "unused.yaml", cwd)  # creates cwd/train.jsonl and cwd/eval.jsonl
    monkeypatch.chdir(cwd)
    cfg, _ = load_recipe(recipe, ["data.eval=eval.jsonl"])
    assert cfg.data.eval == str((cwd / "eval.jsonl").resolve())
    assert cfg.data.train == str((tmp_path / "recipes" / "train.jsonl").resolve())  # untouched by the override


def test_hub_names_and_absolute_paths_are_left_alone(write_recipe, minimal_recipe, tmp_path):
    minimal_recipe["model"] = {"type": "llama", "path": "meta-llama/Llama-3.2-1B"}
    minimal_recipe["data"]["eval"] = str((tmp_path / "eval.jsonl").resolve())
    cfg, _ = load_recipe(write_recipe(minimal_recipe))
    assert cfg.model.path == "meta-llama/Llama-3.2-1B"
    assert cfg.data.eval == str((tmp_path / "eval.jsonl").resolve())


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


# --- files: YAML errors, derived values, round trip -----------------------------------------------------------------


def test_missing_recipe_file_is_a_config_error(tmp_path):
    assert "recipe file not found" in one_error(tmp_path / "nope.yaml")


def test_invalid_yaml_names_the_line(write_recipe):
    path = write_recipe("name: x\nmodel:\n  type: [tiny-llama\ntrain: {}\n")
    message = one_error(path)
    assert "invalid YAML" in message and f"{path.name}:" in message
    line = int(message.split(f"{path.name}:", 1)[1].split(":", 1)[0])
    assert 3 <= line <= 4


def test_recipe_must_be_a_mapping(write_recipe):
    assert "mapping" in one_error(write_recipe("- a\n- b\n"))


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


# --- shipped recipes and presets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", SHIPPED_RECIPES, ids=[p.name for p in SHIPPED_RECIPES])
def test_shipped_recipe_validates_from_any_cwd(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
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
