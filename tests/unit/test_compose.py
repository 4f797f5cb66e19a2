"""finetune.config.compose: a recipe file and its ``extends`` chain, the provenance of every key, typed overrides,
path resolution and the YAML errors of a file, each error one line.

Pure config code: no torch, no training. Validation of the composed recipe is test_validate.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.config import compose, load_recipe
from finetune.config.compose import parse_override
from finetune.errors import ConfigError
from tests.config_helpers import RECIPE_TEXT, one_error

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


# --- extends ------------------------------------------------------------------------------------------------------


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
def test_the_editor_support_example_trains_into_runs_of_its_own_name(write_recipe, tmp_path, base):
    """docs/recipes.md, Editor support: ``name: mine`` over ``extends: [quickstart.yaml]`` (or the bare name, as
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


def test_a_chat_template_file_resolves_against_the_recipe_and_a_name_stays_a_name(write_recipe, minimal_recipe,
                                                                                   tmp_path, monkeypatch):
    """model.chat_template: a path (here not written yet: resolved all the same, so the missing-file line names where
    it was looked for) is made absolute against the file that set it, or the working directory for an override; a
    template's name is left as written, even where a file of that name lies beside the recipe."""
    recipe_dir, cwd = tmp_path / "recipes", tmp_path / "cwd"
    cwd.mkdir()
    (recipe_dir / "templates").mkdir(parents=True)
    (recipe_dir / "templates" / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    (recipe_dir / "chatml").write_text("not read")
    minimal_recipe["model"]["chat_template"] = "templates/mine.jinja"
    recipe = write_recipe(minimal_recipe, folder=recipe_dir)
    monkeypatch.chdir(cwd)
    cfg, _ = load_recipe(recipe)
    assert cfg.model.chat_template == str(recipe_dir / "templates" / "mine.jinja")
    assert compose(recipe, ["model.chat_template=chatml"]).data["model"]["chat_template"] == "chatml"
    assert compose(recipe, ["model.chat_template=other.jinja"]).data["model"]["chat_template"] == \
        str(cwd / "other.jinja")
    minimal_recipe["model"]["chat_template"] = "chatml"
    assert load_recipe(write_recipe(minimal_recipe, folder=recipe_dir))[0].model.chat_template == "chatml"


# --- files: YAML errors -------------------------------------------------------------------------------------------


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
