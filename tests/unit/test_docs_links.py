"""Every relative link of the manual (README.md and docs/*.md) points at a file that exists, and every ``#anchor`` at
a heading of its target page (GitHub's anchors: lowercase, spaces to ``-``, punctuation but ``-`` and ``_`` dropped)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def manual_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(_CODE_SPAN.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """``page: target (why)`` for each relative link of ``page`` that resolves to no file or no heading."""
    broken = []
    for line in _prose_lines(page.read_text()):
        for target in _LINK.findall(line):
            if not target or _SCHEME.match(target) or target.startswith("//"):
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            name, shown = os.path.relpath(page, ROOT), os.path.relpath(resolved, ROOT)
            if not resolved.exists():
                broken.append(f"{name}: {target} (no file {path_part})")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{name}: {target} (no heading #{anchor} in {shown})")
            elif anchor and resolved.suffix != ".md":
                broken.append(f"{name}: {target} (an anchor into a file that is not markdown)")
    return broken


@pytest.mark.parametrize("page", manual_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, "\n".join(broken)


def test_the_manual_has_pages_with_links() -> None:
    """The checks above would pass on nothing: the README links to every topic page under docs/."""
    readme = "\n".join(_prose_lines((ROOT / "README.md").read_text()))
    linked = {target.partition("#")[0] for target in _LINK.findall(readme)}
    pages = {f"docs/{page.name}" for page in manual_pages()[1:]}
    assert pages, "docs/ holds no page"
    assert not pages - linked, f"pages the README does not link to: {sorted(pages - linked)}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("The resident model's life", "the-resident-models-life"),
        ("OpenAPI schema, `/docs` and fuzzing", "openapi-schema-docs-and-fuzzing"),
        ("Files, retries and retention", "files-retries-and-retention"),
        (
            "Accounts: what keys and prices cost, and the ledger under kill -9",
            "accounts-what-keys-and-prices-cost-and-the-ledger-under-kill--9",
        ),
        ("Choosing BATCH_GENERATE_SLOTS", "choosing-batch_generate_slots"),
    ],
)
def test_slug_follows_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_broken_link_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [ok](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [here](#nowhere-here) `[code](ignored.md)`\n"
        "```\n[fenced](ignored.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no file missing.md)",
        "page.md: other.md#nowhere (no heading #nowhere in other.md)",
        "page.md: #nowhere-here (no heading #nowhere-here in page.md)",
    ]
