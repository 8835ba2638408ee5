"""The site's pages as mkdocs.yml's nav lists them: the guides (a task each) and the reference pages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.docs.markdown import DOCS, ROOT


class _Loader(yaml.SafeLoader):
    """mkdocs.yml names Python objects (``!!python/...``); the nav needs none of them."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def config() -> dict[str, Any]:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)


def _pages(entries: list[Any]) -> list[Path]:
    found = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found += _pages(value) if isinstance(value, list) else [DOCS / value]
    return found


def section(title: str) -> list[Path]:
    """The pages of nav section ``title``."""
    (entries,) = [next(iter(e.values())) for e in config()["nav"] if isinstance(e, dict) and title in e]
    return _pages(entries)


def nav_pages() -> list[Path]:
    return _pages(config()["nav"])


GUIDES_SECTION = "Guides"
REFERENCE_SECTION = "Reference"
