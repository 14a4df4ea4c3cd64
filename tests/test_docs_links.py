"""Every local link and image in README.md and docs/**/*.md resolves: the file or folder exists, and
an `#anchor` into a markdown file names one of its headings (GitHub's slugs). http(s) and mailto
links are not checked; links inside code blocks and code spans are not links."""

from __future__ import annotations

import glob
import os
import re
from urllib.parse import unquote

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def _pages():
    pages = [os.path.join(ROOT, "README.md")]
    pages += sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [p for p in pages if os.path.isfile(p)]


def _outside_fences(path):
    """(line number, line) of the lines of a markdown file outside fenced code blocks."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            stripped = line.lstrip()
            if fence is None and stripped.startswith(("```", "~~~")):
                fence = stripped[:3]
                continue
            if fence is not None:
                if stripped.startswith(fence):
                    fence = None
                continue
            yield number, line


def _prose(path):
    """(line number, text) of the lines outside fenced code blocks, code spans replaced by a word."""
    for number, line in _outside_fences(path):
        yield number, CODE_SPAN.sub("code", line.rstrip("\n"))


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path):
    anchors, seen = set(), {}
    for _, line in _outside_fences(path):
        m = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line.rstrip("\n"))
        if m:
            slug = _slug(m.group(1).replace("`", ""))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _broken(path):
    broken = []
    for number, line in _prose(path):
        for target in LINK.findall(line):
            if target.startswith(EXTERNAL):
                continue
            where, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), unquote(where))) if where else path
            if where and not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(path, ROOT)}:{number}: {target} (no such file)")
            elif (
                anchor
                and resolved.endswith(".md")
                and os.path.isfile(resolved)
                and unquote(anchor).lower() not in _anchors(resolved)
            ):
                broken.append(f"{os.path.relpath(path, ROOT)}:{number}: {target} (no such heading)")
    return broken


def test_slugs_follow_github():
    assert _slug("Planning a layout (oases plan, oases.planner)") == "planning-a-layout-oases-plan-oasesplanner"
    assert _slug("GPU results (one NVIDIA H200)") == "gpu-results-one-nvidia-h200"
    assert _slug("What make demo prints") == "what-make-demo-prints"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_local_links_resolve(page):
    broken = _broken(page)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](page.md#title) ![img](missing.png) [gone](page.md#nowhere)\n"
        "`[code](not-a-link.md)` [web](https://example.invalid/x)\n\n```\n[fenced](nope.md)\n```\n"
    )
    assert [b.split(": ", 1)[1] for b in _broken(str(page))] == [
        "missing.png (no such file)",
        "page.md#nowhere (no such heading)",
    ]
