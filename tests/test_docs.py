"""The README is a ten-minute read and the docs/ pages hold the rest (issue 30, item 5): README.md is at
most 420 lines, links every docs/*.md page, and every relative link in README.md and docs/*.md points to
a file that exists -- and, for an ``#anchor`` into the repository's markdown, to a heading there (GitHub's
anchors: lower case, punctuation dropped, spaces to hyphens, a repeated heading numbered ``-1``, ``-2``)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.S | re.M)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """The text without code blocks and code spans (a ``](`` in code is no link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def test_slug_follows_github() -> None:
    assert slug("GPU tables (one H100)") == "gpu-tables-one-h100"
    assert slug("Fine-tune a pretrained checkpoint, export the result") == \
        "fine-tune-a-pretrained-checkpoint-export-the-result"
    assert slug("`comm` in summary.json") == "comm-in-summaryjson"
    assert slug("Which strategy? The advisor") == "which-strategy-the-advisor"


def test_readme_is_a_ten_minute_read() -> None:
    n = len(README.read_text().splitlines())
    assert n <= 420, f"README.md has {n} lines; move detail to a docs/ page"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    targets = {(README.parent / unquote(t.split("#", 1)[0])).resolve() for t in links(README)
               if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")}
    missing = [p.name for p in DOCS if p.resolve() not in targets]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / unquote(file)).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
            continue
        if anchor and dest.suffix == ".md" and dest.is_relative_to(ROOT) and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#nowhere) [file](missing.md) `[code](nope.md)`\n\n"
                    "```\n[in a block](nope.md)\n```\n")
    assert links(page) == ["#title", "#nowhere", "missing.md"]
    assert anchors(page) == {"title"}
