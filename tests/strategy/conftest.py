"""In-process Trainer runs: Lightning keeps the process group and its rendezvous variables after ``fit`` on purpose
(a second ``fit`` reuses them). These tests run many fits in one process, so each ends by releasing them.

The checkpoint tests here use ``checkpoint_format`` (tests/checkpoint/conftest.py) to run against both on-disk formats."""

from __future__ import annotations

import pytest

from tests.checkpoint.conftest import checkpoint_format  # noqa: F401 - the checkpoint tests' format fixture


@pytest.fixture(autouse=True)
def _release_lightning_process_group(release_lightning_process_group):
    """Every test here: tests/conftest.py's ``release_lightning_process_group``."""
