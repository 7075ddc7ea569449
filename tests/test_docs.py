"""The documentation cannot drift from the code: docs/settings.md is what settings_markdown()
renders now, every relative link in README.md and docs/*.md (and every docs/ pointer in the code)
names a file and heading that exist, and the README's index lists every page in docs/."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from deltafin.settings import Settings, settings_markdown

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_POINTER = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a markdown page, spelled as the usual renderers spell them."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _check(page: Path, target: str, anchor: str | None, where: str) -> None:
    assert page.is_file(), f"{where}: links to {target}, which does not exist"
    if anchor:
        assert anchor in _anchors(page), f"{where}: links to {target}#{anchor}, a heading {target} lacks"


def test_settings_page_is_rendered_from_the_settings():
    page = DOCS / "settings.md"
    assert page.read_text() == settings_markdown(), \
        "docs/settings.md is stale: run python tools/settings_doc.py"


def test_every_setting_is_on_the_settings_page():
    page = settings_markdown()
    for f in fields(Settings):
        assert f"| `{f.name}` |" in page and f"`DELTAFIN_{f.name.upper()}`" in page, f.name


def test_relative_links_point_at_existing_files_and_headings():
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            _check(linked, target, anchor, page.relative_to(ROOT).as_posix())


def test_readme_index_lists_every_page():
    readme = (ROOT / "README.md").read_text()
    linked = {t.partition("#")[0] for t in LINK.findall(readme)}
    for page in DOCS.glob("*.md"):
        assert f"docs/{page.name}" in linked, f"README.md's index lacks docs/{page.name}"


def test_pointers_in_code_name_existing_pages_and_headings():
    sources = [*(ROOT / "deltafin").rglob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "tests").glob("*.py")]
    for source in sources:
        for name, anchor in CODE_POINTER.findall(source.read_text()):
            _check(DOCS / name, f"docs/{name}", anchor, source.relative_to(ROOT).as_posix())
