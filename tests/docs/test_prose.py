"""Docs a reader can follow: short sentences on every page, and a guide whose first screen is its task and a snippet.

The rule (tables, code, headings and HTML comments left out; tests/docs/markdown.py splits the sentences): the median
sentence is under 25 words, and no sentence is over 60.
"""

from __future__ import annotations

import re

import pytest

from tests.docs.markdown import ROOT, measure, prose
from tests.docs.site import nav_pages, section

LATER: dict[str, str] = {}
"""Page name -> why its prose test is an expected failure for now (none: every page holds the rule)."""

FIRST_SCREEN_LATER: dict[str, str] = {}


def _params(paths, later=LATER):
    return [
        pytest.param(p, id=p.name, marks=pytest.mark.xfail(strict=True, reason=later[p.name]))
        if p.name in later
        else pytest.param(p, id=p.name)
        for p in paths
    ]


@pytest.mark.parametrize("path", _params([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *nav_pages()]))
def test_sentences_are_short(path):
    m = measure(path)
    assert m.median < 25, f"{path.name}: median sentence {m.median} words"
    assert m.over_60 == [], f"{path.name}: sentences over 60 words"


@pytest.mark.parametrize("path", _params(section("Guides"), FIRST_SCREEN_LATER))
def test_a_guide_opens_with_its_task_and_a_snippet(path):
    """Under the title, a few sentences of what the page is for, then a code block, all within the first screen."""
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# ")
    fence = next(i for i, line in enumerate(lines) if re.match(r"^(```|~~~)", line.strip()))
    assert fence < 20, f"{path.name}: the first code block starts on line {fence + 1}"
    before = " ".join(prose("\n".join(lines[1:fence])))
    assert len(before.split()) <= 80, f"{path.name}: {len(before.split())} words before the first code block"
    assert not [line for line in lines[1:fence] if line.startswith("## ")], f"{path.name}: a section before it"
