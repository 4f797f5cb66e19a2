"""Generate the documentation site's reference pages from the code, so they cannot drift from it.

- ``docs/reference/recipe.md``: every recipe key, read from the pydantic schema (finetune/config/schema.py): its
  dotted name, type (every alternative of a union, every value of a literal, the ranges the schema enforces), the
  schema's own default (``required`` where a recipe must give one) and the schema's description. One table per
  top-level section, in the schema's order; the items of a list of sources or rewards are listed as ``key[].item``.
  Nothing is written by hand here: a key without a description in the schema has none on the page.
- ``docs/reference/cli.md``: every ``finetune`` verb, in the order ``finetune --help`` lists them, read from the
  Typer app (finetune/cli.py) through Click's own help records: usage line, description, arguments and options with
  their help text (and the defaults and ``[required]`` marks ``--help`` prints).
- ``docs/reference/models.md``: the tested model families, one row per SupportedModel of the table
  (finetune/registry.py, in its order): name, task, the config ``model_type`` values it loads, description,
  capabilities, the decoder layer FSDP wraps, debug rows, and each LoRA preset's modules; then the rules for a
  family without a row, from finetune/config/families.py's own docstring. A row added to the table appears on the
  next run of this script (and ``--check`` fails until it has run).

``python scripts/docs_reference.py`` writes the three files; ``--check`` writes nothing and exits 1 with one line when a
committed file differs from what the code gives (tests/unit/test_docs_reference.py runs the same check).
The output is deterministic (schema and CLI order; no paths, dates or machine-dependent values) and is Markdown that
MkDocs renders as written: table pipes escaped, no text that could be read as HTML, unique headings.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # document the finetune of this checkout, not one installed elsewhere
    sys.path.insert(0, str(REPO))

RECIPE_PAGE = Path("docs/reference/recipe.md")
CLI_PAGE = Path("docs/reference/cli.md")
MODELS_PAGE = Path("docs/reference/models.md")
REGENERATE = "python scripts/docs_reference.py"
TOP_LEVEL = "Top-level keys"  # the heading of the keys that are not in a section (name, task, ...)

# --- Markdown text ---------------------------------------------------------------------------------------------------

_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# In prose: a backslash, emphasis markers (an underscore unless it is inside a word: max_seq_len stays as it is,
# Python-Markdown ignores underscores between letters) and angle brackets that could open an HTML tag.
_PROSE_ESCAPES = [(re.compile(r"\\"), r"\\\\"), (re.compile(r"\*"), r"\\*"),
                  (re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])"), r"\\_"), (re.compile("<"), "&lt;"),
                  (re.compile(">"), "&gt;")]


def _escape(text: str, cell: bool = True) -> str:
    """Plain text as Markdown that renders as written; in a table ``cell`` a pipe is escaped too."""
    for pattern, replacement in _PROSE_ESCAPES:
        text = pattern.sub(replacement, text)
    return text.replace("|", "\\|") if cell else text


def prose(text: str, cell: bool = True) -> str:
    """``text`` (a docstring, a Field description, a help string) as one line of Markdown that renders as written:
    its code spans (``x`` or ```x```) kept as code, everything else escaped. For a table ``cell``, a code span
    holding a pipe is refused: Markdown flavours disagree on an escaped pipe inside code."""
    text = " ".join(text.split())
    out, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        code = match.group(2).strip()
        if cell and "|" in code:
            raise ValueError(f"a code span with a pipe cannot go into a table: {match.group(0)!r}")
        out += [_escape(text[last:match.start()], cell), f"`{code}`"]
        last = match.end()
    out.append(_escape(text[last:], cell))
    return "".join(out)


def paragraphs(doc: str | None, cell: bool = False) -> list[str]:
    """A docstring's paragraphs, each as one line of Markdown (Click's ``\\f`` ends the part shown as help)."""
    text = inspect.cleandoc(doc or "").split("\f")[0]
    return [prose(block, cell) for block in re.split(r"\n\s*\n", text) if block.strip()]


def code(text: str) -> str:
    """``text`` as one code span (its text needs no escaping there; a pipe in it would break a table)."""
    if "|" in text or "`" in text:
        raise ValueError(f"cannot be one code span in a table: {text!r}")
    return f"`{text}`"


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """A Markdown table; every cell is already one line of Markdown."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(cell or " " for cell in row).rstrip() + " |" for row in rows]


# --- the recipe schema -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alternative:
    """One member of a key's type: its text (``int``, ``"cosine"``, ``list[str]``) and the ranges the schema puts on
    it (``>= 1``)."""

    text: str
    limits: tuple[str, ...] = ()


@dataclass(frozen=True)
class Key:
    """One row of the recipe reference."""

    name: str  # dotted, as a recipe or an override writes it; items of a list as key[].item
    alternatives: tuple[Alternative, ...]
    limits: tuple[str, ...]  # ranges on the whole value (the field's own constraints)
    default: Any  # the schema's default as YAML data; REQUIRED when a recipe must give it
    description: str | None


REQUIRED = object()  # a recipe must give the key
UNSET = object()  # a file's key outside the pydantic schema (extends:): nothing unless given
_LIMITS = {"ge": ">= {}", "gt": "> {}", "le": "<= {}", "lt": "< {}", "min_length": "len >= {}",
           "max_length": "len <= {}"}


def _limits(metadata: list[Any]) -> tuple[str, ...]:
    """The ranges among pydantic's metadata (annotated_types Ge, Gt, ..., or a nested Field's metadata)."""
    out: list[str] = []
    for item in metadata:
        nested = getattr(item, "metadata", None)
        if isinstance(nested, list):
            out += _limits(nested)
        for attribute, template in _LIMITS.items():
            value = getattr(item, attribute, None)
            if value is not None and not callable(value):
                out.append(template.format(value))
    return tuple(out)


def _is_model(annotation: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def alternatives(annotation: Any) -> list[Alternative]:
    """The members of a (possibly nested, possibly Annotated) type, in the order the schema writes them."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        limits = _limits(list(annotation.__metadata__))
        return [Alternative(alt.text, alt.limits + limits) for alt in alternatives(args[0])]
    if origin in (Union, types.UnionType):
        return [alt for arg in args for alt in alternatives(arg)]
    if annotation is type(None):
        return [Alternative("null")]
    if origin is Literal:  # each value as JSON writes it: "cosine", true
        return [Alternative(json.dumps(value)) for value in args]
    if origin is not None:  # a container: list[str], dict[str, ...], tuple[float, float]
        inner = [alternatives(arg) for arg in args]
        text = ", ".join(" | ".join(alt.text for alt in alts) for alts in inner)
        limits = dict.fromkeys(limit for alts in inner for alt in alts for limit in alt.limits)  # first seen first
        return [Alternative(f"{origin.__name__}[{text}]", tuple(f"each {limit}" for limit in limits))]
    return [Alternative(getattr(annotation, "__name__", str(annotation)))]


def _yaml(value: Any) -> str:
    """``value`` as a recipe writes it (YAML flow style: ``null``, ``true``, ``0.0003``, ``[0.9, 0.999]``)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
    return json.dumps(value) if text.startswith("'") else text  # "no", quoted as the types quote literals


def _default(field: Any) -> Any:
    """The schema's own default as YAML data (tuples as lists), or REQUIRED; never a validated value (validation
    resolves some nulls: train.dropout's null is the task's rule, documented as null)."""
    from pydantic_core import to_jsonable_python

    if field.is_required():
        return REQUIRED
    return to_jsonable_python(field.get_default(call_default_factory=True))


def _item_model(annotation: Any) -> Any:
    """The model of a list's items among a type's members (data.train's sources, grpo.rewards' items), or None."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Annotated, Union, types.UnionType):
        found = [model for arg in (args[:1] if origin is Annotated else args) if (model := _item_model(arg))]
        return found[0] if found else None
    if origin is list and _is_model(args[0]):
        return args[0]
    return None


def field_keys(dotted: str, field: Any) -> Iterator[Key]:
    """The leaf keys of one field: a nested section walked (logging.wandb.*), a list of models followed by its
    items' keys (data.train[].path)."""
    if _is_model(field.annotation):
        yield from keys(field.annotation, f"{dotted}.")
        return
    yield Key(dotted, _field_alternatives(field), _limits(field.metadata), _default(field), field.description)
    item = _item_model(field.annotation)
    if item is not None:
        yield from keys(item, f"{dotted}[].")


def keys(model: Any, prefix: str = "") -> Iterator[Key]:
    """Every leaf key of ``model``, in schema order."""
    for name, field in model.model_fields.items():
        yield from field_keys(f"{prefix}{name}", field)


def _field_alternatives(field: Any) -> tuple[Alternative, ...]:
    """A key's type members: as its annotation says, unless the schema writes the key's JSON Schema itself
    (``json_schema_extra``, e.g. a source's format: a text checked against data.format's values, shown as them)."""
    extra: dict[str, Any] = {}
    if callable(field.json_schema_extra):
        field.json_schema_extra(extra)
    elif isinstance(field.json_schema_extra, dict):
        extra = dict(field.json_schema_extra)
    if {"anyOf", "enum", "const", "type"} & set(extra):
        return _json_alternatives(extra)
    return tuple(alternatives(field.annotation))


def _json_alternatives(node: dict[str, Any]) -> tuple[Alternative, ...]:
    """The members of a small JSON Schema type (``extends:``, which only the file schema has; a key whose schema
    the code writes itself)."""
    names = {"string": "str", "array": "list", "integer": "int", "number": "float", "boolean": "bool", "null": "null"}
    if "anyOf" in node:
        return tuple(alt for member in node["anyOf"] for alt in _json_alternatives(member))
    if "enum" in node or "const" in node:
        return tuple(Alternative(json.dumps(value)) for value in node.get("enum", [node.get("const")]))
    text = names[node["type"]]
    if "items" in node:
        text += "[" + " | ".join(alt.text for alt in _json_alternatives(node["items"])) + "]"
    return (Alternative(text),)


def sections() -> list[tuple[str, str | None, list[Key]]]:
    """(heading, section docstring, keys) per top-level section, in the schema's order; the keys outside every
    section first (with ``extends:``, which only a recipe file has: finetune/config/schema.py's file schema)."""
    from finetune.config.schema import RecipeConfig, recipe_file_schema

    extends = recipe_file_schema()["properties"]["extends"]
    top = [Key("extends", _json_alternatives(extends), (), UNSET, extends["description"])]
    out: list[tuple[str, str | None, list[Key]]] = [(TOP_LEVEL, None, top)]
    for name, field in RecipeConfig.model_fields.items():
        if _is_model(field.annotation):
            out.append((name, field.annotation.__doc__, list(field_keys(name, field))))
        else:
            top += field_keys(name, field)
    return out


def _limits_text(limits: tuple[str, ...]) -> str:
    """`` (`>= 1`, `<= 64`)``; a container's limits on each item as ``each `>= 0` ``."""
    shown = [f"each {code(limit.removeprefix('each '))}" if limit.startswith("each ") else code(limit)
             for limit in limits]
    return f" ({', '.join(shown)})" if shown else ""


def _type_cell(key: Key) -> str:
    """Each member as code, members separated by an escaped pipe; ranges after them."""
    parts = [(code(alt.text) if "|" not in alt.text else _escape(alt.text)) + _limits_text(alt.limits)
             for alt in key.alternatives]  # a union inside a container (dict[str, int | str]) as plain text
    return " \\| ".join(parts) + _limits_text(key.limits)


def _default_cell(key: Key) -> str:
    if key.default is REQUIRED:
        return "required"
    if key.default is UNSET:
        return "not set"
    return code(_yaml(key.default))


def recipe_page() -> tuple[str, int]:
    """The recipe reference and the number of keys it lists."""
    from finetune.config.schema import RecipeConfig

    lines = ["# Recipe reference", "",
             "Every key a recipe may set, generated from the schema (`finetune/config/schema.py`) by "
             f"`scripts/docs_reference.py`: edit the schema, then run `{REGENERATE}`.", "",
             *paragraphs(RecipeConfig.__doc__), "",
             "A key is written in a recipe file as nested YAML (`train: {max_steps: 50}`) or on the command line as a "
             "dotted override (`train.max_steps=50`). `required`: a recipe (or a file it extends) must set it. "
             "A list of mappings (`list[TrainSource]`) is followed by its items' keys, written `key[].item`. "
             "Ranges in parentheses are checked when the recipe is read. `finetune config RECIPE --provenance` "
             "shows the value each key gets and where it comes from; `finetune schema` prints the same schema as "
             "JSON Schema for editors.", ""]
    count = 0
    for heading, doc, section_keys in sections():
        lines += [f"## {heading}", ""]
        if doc:
            lines += [*paragraphs(doc), ""]
        rows = [(code(key.name), _type_cell(key), _default_cell(key), prose(key.description or ""))
                for key in section_keys]
        lines += [*table(("Key", "Type", "Default", "Description"), rows), ""]
        count += len(section_keys)
    return "\n".join(lines).rstrip() + "\n", count


# --- the command line ------------------------------------------------------------------------------------------------


def _usage(command: Any, context: Any) -> str:
    return " ".join(command.get_usage(context).split()).removeprefix("Usage: ")


def _params(command: Any, context: Any, kind: str) -> list[tuple[str, str]]:
    """(names, help) of a command's arguments or options, as ``--help`` prints them."""
    records = [param.get_help_record(context) for param in command.get_params(context)
               if param.param_type_name == kind]
    return [(code(" ".join(names.split())), prose(text)) for names, text in filter(None, records)]


def _command_section(heading: str, command: Any, context: Any) -> list[str]:
    lines = [f"## {heading}", "", "```text", _usage(command, context), "```", "", *paragraphs(command.help), ""]
    for kind, title in (("argument", "Arguments"), ("option", "Options")):
        rows = _params(command, context, kind)
        if rows:
            lines += [f"**{title}**", "", *table((title[:-1], "Description"), rows), ""]
    return lines


def commands() -> tuple[Any, Any, list[tuple[str, Any, Any]]]:
    """The ``finetune`` Click group (Typer builds it), its context, and (name, command, context) per verb, in the
    order ``finetune --help`` lists them."""
    import typer.main

    from finetune.cli import app

    group = typer.main.get_command(app)
    root = group.context_class(group, info_name="finetune")
    listed = [(name, command, command.context_class(command, info_name=name, parent=root))
              for name in group.list_commands(root) if (command := group.get_command(root, name)) is not None]
    return group, root, listed


def cli_page() -> tuple[str, int]:
    """The command-line reference and the number of verbs it lists."""
    group, root, listed = commands()
    lines = ["# Command-line reference", "",
             f"Every `finetune` command, generated from the command line itself (`finetune/cli.py`) by "
             f"`scripts/docs_reference.py`: edit the commands' help, then run `{REGENERATE}`. "
             "`finetune COMMAND --help` prints the same text.", ""]
    lines += [*table(("Command", "Description"),
                     [(f"[{name}](#finetune-{name})", (paragraphs(command.help, cell=True) or [""])[0])
                      for name, command, _ in listed]), ""]
    lines += _command_section("finetune", group, root)
    for name, command, context in listed:
        lines += _command_section(f"finetune {name}", command, context)
    return "\n".join(lines).rstrip() + "\n", len(listed)


# --- the model families ----------------------------------------------------------------------------------------------


def blocks(doc: str | None) -> list[str]:
    """A docstring as Markdown lines: each paragraph one line, a paragraph of ``- `` items a list (one line per item,
    a blank line before it, as Python-Markdown needs), blank lines between blocks."""
    lines: list[str] = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(doc or "")):
        if not block.strip():
            continue
        if block.lstrip().startswith("- "):
            items = re.split(r"^\s*- ", block, flags=re.M)[1:]
            lines += [f"- {prose(item, cell=False)}" for item in items] + [""]
        else:
            lines += [prose(block, cell=False), ""]
    return lines


def _codes(values: Any) -> str:
    """Each value as a code span, comma-separated (a table cell)."""
    return ", ".join(code(str(value)) for value in values)


def models_page() -> tuple[str, int]:
    """The table of tested model families and the number of rows it lists."""
    from finetune import registry
    from finetune.config import families

    rows = list(registry.SHIPPED.values())  # not what a plugin registered in this process
    lines = ["# Model families", "",
             "The tested model families: one row each of finetune's SupportedModel table (`finetune/registry.py`), "
             f"generated by `scripts/docs_reference.py` (add a row, then run `{REGENERATE}`). `finetune models` "
             "prints the same rows. A recipe names one with `model.type`; left out, it is read from the `model_type` "
             "of `model.path`'s config.json, and a causal LM whose family is not listed here trains with a row "
             "derived from transformers ([Families without a row](#families-without-a-row)).", "",
             "## Rows", "",
             "Task: what a `task: null` run of the row trains ([Tasks](../tasks/sft.md)). Model types: the "
             "`model_type` values of the config.json it loads; a folder of another type is refused. Debug: built "
             "from the row's tiny config and bundled tokenizer when `model.path` is null (no download). "
             "Capabilities: `packing` (`data.packing`), `gradient_checkpointing`, `generation` (`exact_match`, "
             "`finetune generate`, task grpo), `preference` (task dpo and reward), `flex_attention`.", ""]
    lines += [*table(("Row", "Task", "Model types", "Description", "Capabilities", "FSDP wraps", "Debug"),
                     [(code(row.name), code(row.task), _codes(row.model_types) or "any",
                       prose(row.description), _codes(sorted(row.capabilities)) or "none",
                       _codes(row.wrap_classes), "yes" if row.debug_build else "")
                      for row in rows]), ""]
    presets = list(dict.fromkeys(name for row in rows for name in row.lora_targets))  # as the first row orders them
    lines += ["## LoRA presets", "",
              "The modules each `peft.preset` adapts: every linear layer whose name is one of these or ends with "
              "`.` and one of these ([LoRA, DoRA, QLoRA and merge](../lora.md)); never adapted: the modules whose "
              "whole name matches the row's exclusion. `peft.target_modules` replaces a preset.", ""]
    lines += [*table(("Row", *presets, "Never adapted"),
                     [(code(row.name), *(_codes(row.lora_targets.get(name, ())) or "none" for name in presets),
                       code(row.lora_exclude) if row.lora_exclude else "")
                      for row in rows]), ""]
    rules = (families.__doc__ or "").split("\n\n", 1)[1]  # after its summary line: the rules, written for users
    lines += ["## Families without a row", "", *blocks(re.sub(r"\s*\(:func:`\w+`\)", "", rules)),
              "To add a row of your own, write a module that calls `finetune.registry.register(SupportedModel(...))` "
              "and name it in the recipe with `model.plugin` (the fields: [Architecture](../architecture.md), "
              "`finetune/registry.py`); a row proposed for this table comes with its tiny config and tests.", ""]
    return "\n".join(lines).rstrip() + "\n", len(rows)


# --- writing and checking --------------------------------------------------------------------------------------------


def pages() -> dict[Path, tuple[str, int]]:
    """Each reference page (relative to the repository) with its text and the number of entries it lists."""
    return {RECIPE_PAGE: recipe_page(), CLI_PAGE: cli_page(), MODELS_PAGE: models_page()}


def stale(root: Path | None = None) -> list[Path]:
    """The pages whose committed text under ``root`` (this checkout) differs from what the code gives (missing ones
    included)."""
    root = REPO if root is None else root
    return [page for page, (text, _) in pages().items()
            if not (root / page).is_file() or (root / page).read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed page is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        if old:
            print(f"{', '.join(map(str, old))}: stale, run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    for page, (text, count) in pages().items():
        path = REPO / page
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        what = {RECIPE_PAGE: "keys", CLI_PAGE: "commands", MODELS_PAGE: "model rows"}[page]
        print(f"{page}: {count} {what}, {len(text.encode())} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
