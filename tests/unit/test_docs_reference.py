"""The documentation's generated reference pages (scripts/docs_reference.py): docs/reference/recipe.md lists every
recipe key with the schema's real default, docs/reference/cli.md every command with each option ``--help`` shows,
docs/reference/models.md every row of the SupportedModel table with its task, model types, capabilities and LoRA
presets; the committed pages are what the code gives now, and all are Markdown that MkDocs renders as written.

The expectations come from elsewhere than the generator: the schema's keys from a plain walk of the pydantic
fields here, the values a key may take from pydantic's own JSON Schema, the commands and options from the help text
the CLI prints, the model rows from the table itself, the rendering from Python-Markdown (the parser MkDocs uses)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, get_args

import pytest
import yaml
from pydantic import BaseModel
from typer.testing import CliRunner

from finetune import registry
from finetune.cli import app
from finetune.config.schema import RecipeConfig
from finetune.registry import SHIPPED, SUPPORTED_MODELS
from tests.cli_helpers import load_script

REPO = Path(__file__).resolve().parents[2]
REGENERATE = "python scripts/docs_reference.py"
CELL_SPLIT = re.compile(r"(?<!\\)\|")  # a table's cell separator: a pipe that is not escaped


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return load_script("docs_reference.py", "docs_reference")


@pytest.fixture(scope="module")
def recipe_md(generator: ModuleType) -> str:
    return generator.recipe_page()[0]


@pytest.fixture(scope="module")
def cli_md(generator: ModuleType) -> str:
    return generator.cli_page()[0]


@pytest.fixture(scope="module")
def models_md(generator: ModuleType) -> str:
    return generator.models_page()[0]


def test_the_committed_pages_are_current(generator: ModuleType) -> None:
    stale = [str(page) for page in generator.stale()]
    assert not stale, f"{', '.join(stale)} stale: run `{REGENERATE}`"


# --- the recipe page -------------------------------------------------------------------------------------------------


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models anywhere inside a type (list[TrainSource] | str -> [TrainSource])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def schema_leaves(model: type[BaseModel], prefix: str = "") -> dict[str, tuple[type[BaseModel], str]]:
    """Every leaf key of the schema -> (its model, its field name); sections are walked, and the models inside a
    leaf's type (the sources of data.train, the items of grpo.rewards) add their keys as ``key[].name``."""
    out: dict[str, tuple[type[BaseModel], str]] = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out.update(schema_leaves(kind, f"{prefix}{name}."))
            continue
        out[f"{prefix}{name}"] = (model, name)
        for inner in _models_in(kind):
            out.update(schema_leaves(inner, f"{prefix}{name}[]."))
    return out


def rows(page: str) -> dict[str, list[str]]:
    """The recipe page's table rows by key: [type, default, description] (cells as Markdown)."""
    out = {}
    for line in page.splitlines():
        match = re.match(r"\| `([\w.\[\]]+)` \|", line)
        if match:
            cells = [cell.strip() for cell in CELL_SPLIT.split(line)[1:-1]]
            assert match.group(1) not in out, f"{match.group(1)} is listed twice"
            out[match.group(1)] = cells[1:]
    return out


def test_the_walk_finds_the_nested_and_listed_keys() -> None:
    """The expectations below can fail: the walk sees sections, nested sections and the items of lists."""
    leaves = schema_leaves(RecipeConfig)
    assert {"name", "model.type", "logging.wandb.mode", "data.train[].weight", "data.eval[].split",
            "grpo.rewards[].regex"} <= set(leaves)
    assert "logging.wandb" not in leaves and "data.eval[].weight" not in leaves


def test_every_schema_key_is_listed_with_its_default(recipe_md: str) -> None:
    listed = rows(recipe_md)
    missing = sorted(set(schema_leaves(RecipeConfig)) - set(listed))
    assert not missing, f"keys recipe.md does not list: {missing}"
    wrong = {}
    for key, (model, name) in schema_leaves(RecipeConfig).items():
        field = model.model_fields[name]
        shown = listed[key][1]
        if field.is_required():
            ok = shown == "required"
        else:
            default = field.get_default(call_default_factory=True)
            expected = list(default) if isinstance(default, tuple) else default  # YAML has no tuples
            ok = shown.startswith("`") and yaml.safe_load(shown.strip("`")) == expected
        if not ok:
            wrong[key] = shown
    assert not wrong, f"defaults recipe.md shows wrongly: {wrong}"
    assert set(listed) - set(schema_leaves(RecipeConfig)) == {"extends"}, "recipe.md lists keys the schema lacks"


def _json_values(node: Any) -> list[Any]:
    """Every enum/const value in a JSON Schema node (not following $refs)."""
    if isinstance(node, list):
        return [value for item in node for value in _json_values(item)]
    if not isinstance(node, dict):
        return []
    own = list(node.get("enum", [])) + ([node["const"]] if "const" in node else [])
    return own + [value for key, item in node.items() if key not in ("enum", "const", "default")
                  for value in _json_values(item)]


def test_every_value_a_key_may_take_is_in_its_type(recipe_md: str) -> None:
    """Literals, a source's formats and ``true`` of exact_match: each value pydantic's JSON Schema allows is shown."""
    listed = rows(recipe_md)
    missing = {}
    for key, (model, name) in schema_leaves(RecipeConfig).items():
        values = _json_values(model.model_json_schema()["properties"][name])
        absent = [value for value in values if f"`{json.dumps(value)}`" not in listed[key][0]]
        if absent:
            missing[key] = absent
    assert not missing, f"values missing from the type column: {missing}"
    assert '`"cosine"`' in listed["scheduler.name"][0] and '`"prompt"`' in listed["data.train[].format"][0]


def test_union_types_show_every_member(recipe_md: str) -> None:
    listed = rows(recipe_md)
    assert listed["data.train"][0].startswith("`str` \\| `list[TrainSource]`")
    assert listed["data.eval"][0].endswith("\\| `null`")
    assert "`null`" in listed["model.path"][0] and "`str`" in listed["model.path"][0]
    assert "`list[RewardSpec]`" in listed["grpo.rewards"][0]


def test_each_top_level_section_has_its_heading(recipe_md: str) -> None:
    headings = re.findall(r"^## (.+)$", recipe_md, re.M)
    sections = [name for name, field in RecipeConfig.model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)]
    assert headings[1:] == sections
    for section in sections:  # each section's table holds exactly its keys
        body = recipe_md.split(f"\n## {section}\n")[1].split("\n## ")[0]
        assert set(rows(body)) == {key for key in schema_leaves(RecipeConfig) if key.startswith(f"{section}.")}


# --- the command-line page -------------------------------------------------------------------------------------------


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], prog_name="finetune", catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _block(text: str, title: str) -> list[str]:
    """The lines of one section of Click's help (``Commands:``, ``Options:``, ``Arguments:``)."""
    lines = text.splitlines()
    if f"{title}:" not in lines:
        return []
    block = lines[lines.index(f"{title}:") + 1:]
    return block[:next((i for i, line in enumerate(block) if not line.startswith(" ")), len(block))]


def help_verbs() -> list[str]:
    return [line.split()[0] for line in _block(_help(), "Commands") if line.startswith("  ") and line[2] != " "]


def help_options(*verb: str) -> list[str]:
    """The option strings ``finetune VERB --help`` shows (-o, --output, --help, ...)."""
    found = []
    for line in _block(_help(*verb), "Options"):
        names = re.split(r"\s{2,}", line.strip())[0] if line.startswith("  -") else ""
        found += re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", names)
    return found


def _section(page: str, heading: str) -> str:
    return page.split(f"\n## {heading}\n")[1].split("\n## ")[0]


def test_the_help_parsing_finds_verbs_and_options() -> None:
    """The expectations below can fail: the parsing sees the commands and their options."""
    verbs = help_verbs()
    assert verbs[:2] == ["run", "preprocess"] and "eval" in verbs and "schema" in verbs
    assert {"-o", "--output", "--max-new-tokens", "--help"} <= set(help_options("generate"))


def test_every_verb_is_listed_in_help_order(cli_md: str) -> None:
    headings = re.findall(r"^## finetune (\S+)$", cli_md, re.M)
    assert headings == help_verbs()


@pytest.mark.parametrize("verb", ["", *help_verbs()])
def test_every_option_of_a_verb_is_listed(cli_md: str, verb: str) -> None:
    section = _section(cli_md, f"finetune {verb}".strip())
    usage = _help(*filter(None, [verb])).splitlines()[0].removeprefix("Usage: ")
    assert f"\n{usage}\n" in section, f"finetune {verb}: usage line {usage!r} not in cli.md"
    table_cells = [CELL_SPLIT.split(line)[1] for line in section.splitlines() if line.startswith("| `")]
    missing = [option for option in help_options(*filter(None, [verb]))
               if not any(re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", cell) for cell in table_cells)]
    assert not missing, f"finetune {verb}: options not in cli.md: {missing}"


# --- the model families page ------------------------------------------------------------------------------------------


def _table_rows(page: str, heading: str) -> dict[str, list[str]]:
    """The rows of the table under ``## heading``, by their first cell's code (the row name): the other cells."""
    out = {}
    for line in _section(page, heading).splitlines():
        match = re.match(r"\| `([^`]+)` \|", line)
        if match:
            assert match.group(1) not in out, f"{match.group(1)} is listed twice"
            out[match.group(1)] = [cell.strip() for cell in CELL_SPLIT.split(line)[2:-1]]
    return out


def _codes(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_every_row_is_listed_with_its_task_types_capabilities_and_presets(models_md: str) -> None:
    listed, presets = _table_rows(models_md, "Rows"), _table_rows(models_md, "LoRA presets")
    assert list(listed) == list(SHIPPED) == list(presets), "one row per shipped SupportedModel, in table order"
    header = [cell.strip() for cell in CELL_SPLIT.split(_section(models_md, "LoRA presets").split("\n| Row")[1]
                                                         .splitlines()[0])[1:-1]]
    for name, row in SHIPPED.items():
        task, types, description, capabilities, wraps, debug = listed[name]
        assert _codes(task) == [row.task] and _codes(types) == list(row.model_types)
        assert set(_codes(capabilities)) == set(row.capabilities) and _codes(wraps) == list(row.wrap_classes)
        assert (debug == "yes") == row.debug_build and description.startswith(row.description.split("(")[0][:20])
        for preset, modules in row.lora_targets.items():
            assert _codes(presets[name][header.index(preset)]) == list(modules), (name, preset)


def test_a_row_added_to_the_table_appears_when_the_page_is_generated(generator: ModuleType,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What the other rows get: a row added to the shipped table (as a new family's is) is a row of the page, and
    the committed page is then stale until the script runs."""
    added = dataclasses.replace(SHIPPED["llama"], name="newfamily", model_types=("newfamily",),
                                description="a family added to the table")
    monkeypatch.setattr(registry, "SHIPPED", MappingProxyType({**SHIPPED, "newfamily": added}))
    page, count = generator.models_page()
    assert count == len(SHIPPED) + 1 and "newfamily" in _table_rows(page, "Rows")
    assert "| `newfamily` | `causal_lm` | `newfamily` | a family added to the table |" in page
    assert generator.MODELS_PAGE in generator.stale()


def test_the_page_states_the_rules_for_a_family_without_a_row(models_md: str) -> None:
    """The section is the families module's own text: the selection rule, the derivation and the way to add a row."""
    section = _section(models_md, "Families without a row")
    for words in ("`llama` and the debug `tiny-llama` both list `llama`", "`_no_split_modules`", "`attn_mlp`",
                  "never `packing`, `flex_attention` or `preference`", "`model.plugin`", "../architecture.md"):
        assert words in section, words


# --- Markdown ---------------------------------------------------------------------------------------------------------


def _outside_code(page: str) -> str:
    """The page without its fenced blocks and code spans."""
    page = re.sub(r"^```.*?^```", "", page, flags=re.M | re.S)
    return re.sub(r"(`+).+?\1", "", page)


@pytest.mark.parametrize("page", ["recipe", "cli", "models"])
def test_the_page_is_plain_markdown(page: str, recipe_md: str, cli_md: str, models_md: str) -> None:
    text = {"recipe": recipe_md, "cli": cli_md, "models": models_md}[page]
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M)
    assert len(headings) == len(set(headings)), f"headings repeat: {headings}"
    prose = _outside_code(text)
    assert "<" not in prose and ">" not in prose, "raw angle brackets outside code could be read as HTML"
    for table in re.findall(r"(?:^\|.*\n)+", text, re.M):  # every row has as many cells as its header
        widths = {len(CELL_SPLIT.split(line)) for line in table.splitlines()}
        assert len(widths) == 1 and all(line.endswith(" |") for line in table.splitlines()), table
    assert str(REPO) not in text and str(Path.home()) not in text, "an absolute path of this machine"


@pytest.mark.parametrize("page", ["recipe", "cli", "models"])
def test_python_markdown_renders_the_tables_as_written(page: str, recipe_md: str, cli_md: str, models_md: str) -> None:
    """Rendered as MkDocs renders it (Python-Markdown's tables): every row has its header's cells, and the text
    shows no stray escapes, emphasis or HTML of its own (the models page's rules are a list)."""
    markdown = pytest.importorskip("markdown")
    html = markdown.markdown({"recipe": recipe_md, "cli": cli_md, "models": models_md}[page],
                             extensions=["tables", "toc"])
    for table in re.findall(r"<table>(.*?)</table>", html, re.S):
        header = len(re.findall(r"<th[ >]", table))
        cells = [len(re.findall(r"<td[ >]", row)) for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]]
        assert set(cells) == {header}, table[:300]
    tags = set(re.findall(r"</?([a-z0-9]+)", html))
    lists = {"ul", "li"} if page == "models" else set()
    assert tags <= {"h1", "h2", "p", "table", "thead", "tbody", "tr", "th", "td", "code", "pre", "a", "strong",
                    *lists}, tags
    assert "\\" not in re.sub(r"<code>.*?</code>", "", html, flags=re.S), "an escape rendered literally"


def test_the_escaping_keeps_text_as_written(generator: ModuleType) -> None:
    markdown = pytest.importorskip("markdown")
    text = "a | b, <output_dir>, *x* and __init__, max_seq_len, `c <d>`"
    expected = "a | b, &lt;output_dir&gt;, *x* and __init__, max_seq_len, <code>c &lt;d&gt;</code>"
    assert markdown.markdown(generator.prose(text, cell=False)) == f"<p>{expected}</p>"
    cell = markdown.markdown(f"| h |\n| --- |\n| {generator.prose(text)} |", extensions=["tables"])
    assert f"<td>{expected}</td>" in cell
    assert markdown.markdown(generator.prose("`a | b`", cell=False)) == "<p><code>a | b</code></p>"
    with pytest.raises(ValueError, match="pipe"):
        generator.prose("`a | b`")


# --- the script ------------------------------------------------------------------------------------------------------


def test_check_says_what_to_run_and_writing_makes_it_pass(generator: ModuleType, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(generator, "REPO", tmp_path)
    (tmp_path / "docs/reference").mkdir(parents=True)
    (tmp_path / "docs/reference/cli.md").write_text("# old\n")
    assert generator.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and REGENERATE in err and "recipe.md" in err and "cli.md" in err and "models.md" in err
    assert generator.main([]) == 0
    assert generator.main(["--check"]) == 0
    assert (tmp_path / "docs/reference/recipe.md").read_text() == generator.recipe_page()[0]


def test_every_schema_key_has_a_description() -> None:
    """The reference page shows the schema's own text, so a key without a description is a blank row a user
    cannot read: every key (top-level scalars, section keys, list items' keys) carries one."""
    bare = sorted(key for key, (model, name) in schema_leaves(RecipeConfig).items()
                  if not (model.model_fields[name].description or "").strip())
    assert not bare, f"schema keys without a description: {bare}"


def test_a_row_a_plugin_registers_is_not_a_shipped_row(generator: ModuleType, models_md: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The table lists the rows finetune ships and tests: a row registered at run time (a plugin's, or another
    test's in this process) leaves the generated page as committed."""
    plugin_row = dataclasses.replace(SHIPPED["llama"], name="plugin-family", description="a plugin's row")
    monkeypatch.setitem(SUPPORTED_MODELS, "plugin-family", plugin_row)
    page, count = generator.models_page()
    assert page == models_md and count == len(SHIPPED) and "plugin-family" not in page
