"""Everything the README, docs/ and the code's docstrings refer to is in the repository, and the documentation site
builds.

A path a user is pointed at (``docs/platform-notes.md``, ``recipes/presets/lora.yaml``, ``scripts/bench_...py``)
must exist in a checkout; nothing points outside the repository (no notes that only the developers have). Every
relative link and ``#anchor`` of README.md and the docs pages resolves (checked here in plain Python, so a failure
names the file and the link), and ``mkdocs build --strict`` (what ``make docs`` runs) builds the site with no
warning: CI runs ``make test``, so a broken link fails CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
TOP = ("docs", "recipes", "accelerate_configs", "scripts", "finetune", "tests", ".ci")
# a repository path: one of the top-level folders, then path characters, ending in a file suffix
FOLDERS = "|".join(map(re.escape, TOP))
PATH = re.compile(rf"(?<![\w./-])((?:{FOLDERS})/[\w./-]*\.(?:md|py|yaml|yml|jsonl|csv|json|txt))")


def pages() -> list[Path]:
    """README.md and every markdown page of the docs site (docs/ and its folders)."""
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def sources() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile", REPO / "mkdocs.yml", *pages()[1:]]
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


# The annotated recipe (docs/recipes.md, "Every key, with its default"): keys a user sets for their own run (no
# default, or an example of one), and what the schema would give them. Every other value shown is the schema's
# default, and every key is shown.
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

    text = (DOCS / "recipes.md").read_text(encoding="utf-8")
    start = text.index("```yaml\nextends: [presets/fp16.yaml]")
    shown = flatten(yaml.safe_load(text[start + len("```yaml\n"):text.index("```", start + 7)]))
    schema = flatten(_schema_defaults(RecipeConfig))
    wrong = {key: (value, schema.get(key, "<not a key>")) for key, value in shown.items()
             if key not in USER_SET and (key not in schema or value != schema[key])}
    assert not wrong, f"docs/recipes.md value -> schema default: {wrong}"
    missing = sorted(key for key in schema if key not in shown)
    assert not missing, f"keys the annotated recipe does not show: {missing}"


FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code spans, where a ``[x](y)`` or ``# x`` is not markup."""
    text = FENCE.sub("", text)
    return re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", "", text, flags=re.S)


def slug(heading: str) -> str:
    """The anchor Python-Markdown's ``toc`` extension (what MkDocs uses) gives a heading: its text without markup,
    ASCII, lowercased, every run of characters but word characters, spaces and hyphens dropped, spaces and hyphens
    joined into one hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*_]", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings, a repeated one numbered as ``toc`` numbers it (``x``, ``x_1``, ...)."""
    found: set[str] = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(match.group(2))
        name, n = base, 0
        while name in found:
            n += 1
            name = f"{base}_{n}"
        found.add(name)
    return found


def broken_links(page: Path) -> list[str]:
    """Every relative link of ``page`` that does not resolve, with why: a missing file, a missing ``#anchor``, or (on
    a docs page) a link out of docs/, which the site cannot follow (write such a path as code: `recipes/x.yaml`)."""
    problems = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{target}: no such file")
            continue
        if DOCS in page.parents and DOCS not in resolved.parents:
            problems.append(f"{target}: leaves docs/, so the site cannot link it; write the path as code instead")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: {resolved.name} has no heading with the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, f"{page.relative_to(REPO)}: broken links: {problems}"


def test_the_link_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing page, a missing anchor and a link out of docs/ are each named; links in code, a page's own heading
    and an external address are not."""
    docs = tmp_path / "docs"
    (docs / "tasks").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("x")
    (docs / "b.md").write_text("# B\n\n## Run it: `finetune run` now\n\n## Run it: `finetune run` now\n")
    page = docs / "tasks" / "a.md"
    page.write_text("# A\n\n[ok](../b.md#run-it-finetune-run-now) [twice](../b.md#run-it-finetune-run-now_1) "
                    "[self](#a) [web](https://example.org/x.md) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n"
                    "[gone](../c.md) [no anchor](../b.md#nothing) [out](../../notes.txt)\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", docs)
    problems = broken_links(page)
    assert [p.split(":")[0] for p in problems] == ["../c.md", "../b.md#nothing", "../../notes.txt"], problems


def items_nested_by_two(text: str) -> list[str]:
    """The list items of a markdown page indented by 1 to 3 spaces (outside code): Python-Markdown nests an item
    only under 4, so the site would show them at the level above."""
    return [line.strip() for line in FENCE.sub("", text).splitlines() if re.match(r" {1,3}(?:[-*+]|\d+\.) ", line)]


@pytest.mark.parametrize("page", pages()[1:], ids=lambda p: str(p.relative_to(REPO)))
def test_nested_list_items_are_indented_by_four_spaces(page: Path) -> None:
    nested = items_nested_by_two(page.read_text(encoding="utf-8"))
    assert not nested, f"{page.relative_to(REPO)}: indent these items by 4 spaces for the site: {nested}"
    assert items_nested_by_two("- a\n  - b\n    - c\n```\n  - code\n```\n") == ["- b"]


def lists_left_as_text(html: str) -> list[str]:
    """The list items a page shows as plain text: Python-Markdown (unlike GitHub) reads a list right after a
    paragraph line as text of the paragraph."""
    article = re.sub(r"<pre.*?</pre>", "", html, flags=re.S)
    return [m.group(0).strip() for m in re.finditer(r"\n[ \t]*[-*+] [^\n<]{0,60}", article)]


def test_the_list_check_can_fail() -> None:
    import markdown

    assert lists_left_as_text(markdown.markdown("Intro:\n- a\n- b\n")) == ["- a", "- b"]
    assert not lists_left_as_text(markdown.markdown("Intro:\n\n- a\n    - nested\n\n```\n- code\n```\n",
                                                    extensions=["fenced_code"]))


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (``make docs``): mkdocs.yml makes a broken link or anchor, and a page left out of
    the navigation, a warning, and --strict makes every warning an error. No page shows a list as text."""
    import yaml

    validation = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["validation"]
    assert validation["links"]["not_found"] == validation["links"]["anchors"] == "warn"
    assert validation["omitted_files"] == validation["nav"]["not_found"] == "warn"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "recipes" / "index.html").is_file()
    for page in sorted((tmp_path / "site").rglob("index.html")):
        article = re.search(r"<article.*?</article>", page.read_text(encoding="utf-8"), flags=re.S)
        left = lists_left_as_text(article.group(0) if article else "")
        assert not left, f"{page.parent.relative_to(tmp_path / 'site')}: list items shown as text: {left}"
