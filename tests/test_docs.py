"""The docs' relative links resolve: each linked file exists and each #anchor names a heading of it.

Anchors follow GitHub's rule for headings (lowercase; letters, marks, decimal digits, underscores,
hyphens and spaces kept, spaces as hyphens, everything else dropped; a repeated heading gets -1, -2).
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = (c for c in text if c in " -" or unicodedata.category(c)[0] in "LM"
            or unicodedata.category(c) in ("Nd", "Pc"))
    return "".join(kept).replace(" ", "-")


def prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    repeats: dict[str, int] = {}
    for line in prose(path):
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1).replace("`", ""))
            n = repeats.get(s, 0)
            repeats[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def test_slug_follows_githubs_rule():
    assert slug("2026-12-07, scale 8's sites (commits 50c0ee3, 1913e4c)") == \
        "2026-12-07-scale-8s-sites-commits-50c0ee3-1913e4c"
    assert slug("Sites at 16³ – the [log](x.md)") == "sites-at-16--the-log"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in DOCS:
        for line in prose(doc):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # not inside code spans
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file, _, frag = target.partition("#")
                dest = (doc.parent / file) if file else doc
                if not dest.exists():
                    broken.append(f"{doc.relative_to(ROOT)}: no file {target}")
                elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                    broken.append(f"{doc.relative_to(ROOT)}: no heading for {target}")
    assert not broken, "\n".join(broken)
