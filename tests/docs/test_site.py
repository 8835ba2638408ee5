"""The documentation site: every page is in the nav, and the API reference is generated for every public name.

The site itself is built with warnings as errors (broken links and anchors fail) by scripts/test.sh:
``mkdocs build --strict``.
"""

from __future__ import annotations

import re

import lightning_ft
from tests.docs.markdown import DOCS, ROOT
from tests.docs.site import nav_pages, section


def test_every_page_in_docs_is_in_the_site_s_nav_once():
    pages = nav_pages()
    assert sorted(pages) == sorted(DOCS.glob("*.md"))
    assert len(pages) == len(set(pages))


def test_the_api_reference_is_generated_from_the_docstring_of_every_public_name():
    api = (DOCS / "api.md").read_text()
    generated = re.findall(r"^::: lightning_ft\.(\w+)$", api, flags=re.M)
    assert sorted(generated) == sorted(lightning_ft.__all__)
    assert DOCS / "api.md" in section("Reference")


def _task_table(markdown: str) -> list[tuple[str, str]]:
    """The rows of the "I want to ..." table: (task, linked page and anchor, relative to docs/)."""
    section = markdown.split("## I want to ...", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| \[[^\]]*\]\(([^)]*)\) \|$", section, flags=re.M)
    return [(task, link.removeprefix("docs/")) for task, link in rows]


def test_the_readme_and_the_site_s_home_name_the_same_page_for_every_task():
    readme = _task_table((ROOT / "README.md").read_text())
    home = _task_table((DOCS / "index.md").read_text())
    assert readme and [row for row in readme if row[1] != "CONTRIBUTING.md"] == home
    # Every guide is the answer to some task, replica groups included.
    assert {p.name for p in section("Guides")} <= {link.split("#")[0] for _, link in home}
