"""Every Python block of README.md and docs/ runs as written, unless the page marks it a fragment (``notest``).

pytest-markdown-docs collects the blocks; tests/docs/markdown_blocks.py gives each a fresh working folder and a
``model``. It runs in a pytest of its own: the blocks train, and their process group and files stay out of this one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.docs.markdown import DOCS, ROOT, blocks
from tests.helpers import subprocess_env

pytestmark = pytest.mark.slow

LATER: set[str] = set()
"""Pages whose blocks do not run yet (none: every page's blocks run or say why not)."""


def _pages():
    return [ROOT / "README.md", *(p for p in sorted(DOCS.glob("*.md")) if p.name not in LATER)]


def test_every_python_block_that_is_not_a_fragment_runs():
    pages = _pages()
    runnable = [b for p in pages for b in blocks(p) if b.language == "python" and b.marker is None]
    assert runnable, "no runnable python block"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.docs.markdown_blocks"]
        + ["--markdown-docs", "--rootdir", str(ROOT), *map(str, pages)],
        cwd=ROOT,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"{len(runnable)} passed" in done.stdout, done.stdout[-3000:]


def test_a_fragment_says_why_it_does_not_run():
    pages = _pages()
    silent = [f"{b.path.name}:{b.line}" for p in pages for b in blocks(p) if b.marker == ("notest", "")]
    assert silent == []
