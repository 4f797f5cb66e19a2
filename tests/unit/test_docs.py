"""Everything the README, docs/ and the code's docstrings refer to is in the repository.

A path a user is pointed at (``docs/platform-notes.md``, ``recipes/presets/lora.yaml``, ``scripts/bench_...py``)
must exist in a checkout; nothing points outside the repository (no notes that only the developers have)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP = ("docs", "recipes", "accelerate_configs", "scripts", "finetune", "tests", ".ci")
# a repository path: one of the top-level folders, then path characters, ending in a file suffix
FOLDERS = "|".join(map(re.escape, TOP))
PATH = re.compile(rf"(?<![\w./-])((?:{FOLDERS})/[\w./-]*\.(?:md|py|yaml|yml|jsonl|csv|json|txt))")


def sources() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md"))]
    files += sorted((REPO / "finetune").rglob("*.py")) + sorted((REPO / "scripts").glob("*.py"))
    files += sorted((REPO / "recipes").rglob("*.yaml")) + sorted((REPO / "accelerate_configs").glob("*.yaml"))
    return [f for f in files if f.is_file()]


@pytest.mark.parametrize("source", sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_referenced_repository_file_exists(source: Path) -> None:
    text = source.read_text(encoding="utf-8")
    missing = sorted({m for m in PATH.findall(text) if "*" not in m and not (REPO / m.rstrip(".")).exists()
                      and not m.startswith(("tests/tmp", "recipes/my"))})
    assert not missing, f"{source.relative_to(REPO)} refers to files that are not in the repository: {missing}"


@pytest.mark.parametrize("source", sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_nothing_points_outside_the_repository(source: Path) -> None:
    text = source.read_text(encoding="utf-8")
    for outside in ("ENV-NOTES", "../shared", "shared/", "DESIGN.md"):
        assert outside not in text, f"{source.relative_to(REPO)} mentions {outside!r}, which is not in the repository"


def test_the_pattern_finds_references() -> None:
    """The check above can fail: it sees the references this file's own docstring makes."""
    found = PATH.findall(Path(__file__).read_text(encoding="utf-8").split('"""')[1])
    assert "docs/platform-notes.md" in found and "recipes/presets/lora.yaml" in found


# The annotated recipe in the README: keys a user sets for their own run (no default, or an example of one), and
# what the schema would give them. Every other value shown is the schema's default, and every key is shown.
USER_SET = {"extends", "name", "model.type", "data.format", "data.train", "data.eval", "train.max_steps"}


def _schema_defaults(model: type) -> dict:
    """The schema's own default of every key (``<required>`` where a user must give one), nested as recipes are;
    read from the pydantic fields, not from a validated recipe (validation resolves some nulls, e.g. dropout)."""
    from pydantic import BaseModel

    out: dict = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out[name] = _schema_defaults(kind)
        else:
            value = "<required>" if field.is_required() else field.get_default(call_default_factory=True)
            out[name] = list(value) if isinstance(value, tuple) else value  # YAML has no tuples
    return out


def test_the_annotated_recipe_shows_every_key_with_its_real_default() -> None:
    import yaml

    from finetune.config import RecipeConfig
    from finetune.config.compose import flatten

    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("```yaml\nextends: [presets/fp16.yaml]")
    shown = flatten(yaml.safe_load(text[start + len("```yaml\n"):text.index("```", start + 7)]))
    schema = flatten(_schema_defaults(RecipeConfig))
    wrong = {key: (value, schema.get(key, "<not a key>")) for key, value in shown.items()
             if key not in USER_SET and (key not in schema or value != schema[key])}
    assert not wrong, f"README value -> schema default: {wrong}"
    missing = sorted(key for key in schema if key not in shown)
    assert not missing, f"keys the annotated recipe does not show: {missing}"
