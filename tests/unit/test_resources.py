"""finetune/config/resources.py in this checkout: the shipped recipes and accelerate configs are found without a path
relative to the working folder, recipes can be named on the command line, and an existing file always wins.

The same behaviour from an installed wheel is tests/integration/test_wheel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.config import resources
from finetune.config.validate import accelerate_config_path
from finetune.errors import ConfigError
from tests.cli_helpers import assert_user_error, main_exit

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("in_tmp")  # each test runs in its tmp_path (tests/conftest.py)


def test_the_shipped_folders_are_the_checkouts_top_level_folders() -> None:
    assert resources.recipes_dir().resolve() == REPO / "recipes"
    assert resources.accelerate_configs_dir().resolve() == REPO / "accelerate_configs"
    assert resources.recipe_names() == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert "zero2" in resources.accelerate_config_names() and "quickstart" in resources.recipe_names()


def test_a_checkout_without_the_mapped_packages_still_finds_its_folders() -> None:
    """PYTHONPATH=<checkout>, or an editable install from before the folders were packaged."""
    assert resources._checkout_folder(resources.RECIPES_PACKAGE) == REPO / "recipes"
    assert resources._checkout_folder(resources.ACCELERATE_CONFIGS_PACKAGE) == REPO / "accelerate_configs"


def test_a_bare_name_is_the_shipped_recipe(tmp_path: Path) -> None:
    assert resources.resolve_recipe("quickstart").resolve() == REPO / "recipes" / "quickstart.yaml"
    assert resources.resolve_recipe(Path("minilm-classification")).name == "minilm-classification.yaml"


def test_an_existing_file_wins_over_a_shipped_name(tmp_path: Path) -> None:
    (tmp_path / "quickstart").write_text("name: mine\n")
    assert resources.resolve_recipe("quickstart") == Path("quickstart")


@pytest.mark.parametrize("given", ["nope.yaml", "sub/quickstart", "quickstart.yaml", "./quickstart", ""])
def test_paths_are_left_for_compose_to_report(given: str) -> None:
    assert resources.resolve_recipe(given) == Path(given)


def test_an_unknown_name_is_one_line_listing_the_shipped_names() -> None:
    with pytest.raises(ConfigError) as info:
        resources.resolve_recipe("quickstrat")
    message = str(info.value)
    assert "\n" not in message and "'quickstrat'" in message
    assert all(name in message.split("shipped:", 1)[1] for name in resources.recipe_names())


def test_finetune_recipes_dir_replaces_the_shipped_recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "house.yaml").write_text("name: house\n")
    monkeypatch.setenv("FINETUNE_RECIPES_DIR", str(site))
    assert resources.recipe_names() == ["house"]
    assert resources.resolve_recipe("house") == site / "house.yaml"
    with pytest.raises(ConfigError, match="shipped: house"):
        resources.resolve_recipe("quickstart")


def test_accelerate_configs_by_name_or_by_path(tmp_path: Path) -> None:
    assert accelerate_config_path("zero2") == (REPO / "accelerate_configs" / "zero2.yaml").resolve()
    mine = tmp_path / "zero2"
    mine.write_text("distributed_type: NO\n")
    assert accelerate_config_path("zero2") == mine.resolve()  # an existing file wins
    assert accelerate_config_path("../accelerate_configs/cpu") is None  # a name never leaves the folder
    assert resources.shipped_accelerate_config("nope") is None


def test_config_and_dry_run_by_name_from_another_folder(monkeypatch, capsys, tmp_path: Path) -> None:
    code, out, err = main_exit(monkeypatch, capsys, "config", "quickstart", "launch.accelerate_config=zero2")
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert Path(cfg["data"]["train"]).resolve() == REPO / "recipes" / "data" / "reverse_train.jsonl"
    assert cfg["output_dir"] == str(tmp_path / "runs" / "quickstart")  # relative to the working folder
    code, out, err = main_exit(monkeypatch, capsys, "run", "quickstart", "--dry-run", "--accelerate-config", "ddp")
    assert code == 0, err
    assert f"effective settings ({(REPO / 'accelerate_configs' / 'ddp.yaml').resolve()})" in out


def test_an_unknown_recipe_name_or_accelerate_config_exits_2(monkeypatch, capsys) -> None:
    lines = assert_user_error(*main_exit(monkeypatch, capsys, "run", "quickstrat", "--dry-run"), "quickstart")
    assert len(lines) == 1
    lines = assert_user_error(*main_exit(monkeypatch, capsys, "config", "quickstart", "launch.accelerate_config=x9"),
                              "launch.accelerate_config: 'x9'", "'zero2'")
    assert len(lines) == 1
