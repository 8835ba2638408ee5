"""pytest plugin: the Python blocks of README.md and docs/ run as the pages show them, through pytest-markdown-docs.

``python -m pytest -p tests.docs.markdown_blocks --markdown-docs README.md docs`` (tests/docs/test_python_blocks.py
runs it). Every ``python`` block runs, in a fresh working folder, unless the line before it is a
``<!-- notest: why -->`` comment (a fragment; tests/docs/markdown.py). A block that trains finds ``model``: a small
LightningModule with its own training data, standing for the reader's own, as the guides say.
"""

from __future__ import annotations

import os
import re

import pytest

_NOT_RUN = re.compile(r"^\s*<!--\s*notest\b")


@pytest.hookimpl(tryfirst=True)
def pytest_markdown_docs_markdown_it():
    from markdown_it import MarkdownIt

    parser = MarkdownIt("commonmark")

    def mark_blocks(state) -> None:
        tokens = state.tokens
        for i, token in enumerate(tokens):
            if token.type != "fence" or (token.info.split() or [""])[0] not in ("python", "py", "python3"):
                continue
            before = tokens[i - 1] if i else None
            if before is not None and before.type == "html_block" and _NOT_RUN.match(before.content):
                token.info += " notest"
            else:
                token.info += " fixture:model fixture:docs_folder"

    parser.core.ruler.push("lightning_ft_docs_markers", mark_blocks)
    return parser


@pytest.fixture
def docs_folder(tmp_path, monkeypatch):
    """A fresh working folder for the block (its checkpoints and event log land there); the process group and the
    environment variables a fit leaves are released after it."""
    import torch.distributed as dist

    monkeypatch.chdir(tmp_path)
    before = dict(os.environ)
    yield tmp_path
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture
def model():
    """The reader's LightningModule: examples/quickstart.py's regressor, with its own training data."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Regressor()
