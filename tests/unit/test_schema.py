"""`finetune schema`: the JSON Schema editors use for recipe files. Every shipped recipe and preset validates
against it, and the mistakes finetune refuses (unknown keys, wrong types, values out of range or not in an enum)
are marked by it too, so an editor shows them while typing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from finetune.cli import app
from finetune.config.schema import recipe_file_schema

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "recipes").glob("*.yaml")) + sorted((REPO / "recipes" / "presets").glob("*.yaml"))


def validator() -> jsonschema.Draft202012Validator:
    schema = recipe_file_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_and_preset_validates(path: Path) -> None:
    errors = [e.message for e in validator().iter_errors(yaml.safe_load(path.read_text()))]
    assert not errors, (path.name, errors)


@pytest.mark.parametrize(("recipe", "needle"), [
    ({"train": {"max_stepz": 5}}, "max_stepz"),                     # unknown key: a typo
    ({"bogus": 1}, "bogus"),                                          # unknown top-level section
    ({"optim": {"lr": -1}}, "-1"),                                    # out of range
    ({"data": {"format": "chatml"}}, "chatml"),                       # not in the enum
    ({"train": {"micro_batch_size": "eight"}}, "eight"),              # wrong type
    ({"extends": 3}, "3"),                                            # extends must be a path or a list of paths
])
def test_the_mistakes_finetune_refuses_are_marked(recipe: dict, needle: str) -> None:
    errors = [e.message for e in validator().iter_errors(recipe)]
    assert errors and any(needle in message for message in errors), errors


def test_a_fragment_with_extends_is_valid() -> None:
    assert not list(validator().iter_errors({"extends": ["quickstart.yaml", "presets/lora.yaml"],
                                             "train": {"max_steps": 5}}))


def test_the_command_prints_the_schema_without_heavy_imports() -> None:
    result = CliRunner().invoke(app, ["schema"], catch_exceptions=False)
    assert result.exit_code == 0
    assert json.loads(result.stdout) == recipe_file_schema()
    script = ("import sys, contextlib, io, finetune.cli\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n"
              "    try: finetune.cli.app(['schema'], prog_name='finetune')\n"
              "    except SystemExit: pass\n"
              "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
