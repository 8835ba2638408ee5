"""The documentation site: every page is in the nav, and the API reference is generated for every public name.

The site itself is built with warnings as errors (broken links and anchors fail) by scripts/test.sh:
``mkdocs build --strict``.
"""

from __future__ import annotations

import re

import lightning_ft
from tests.docs.markdown import DOCS
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
