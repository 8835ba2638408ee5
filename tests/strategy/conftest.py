"""In-process Trainer runs: Lightning keeps the process group and its rendezvous variables after ``fit`` on purpose
(a second ``fit`` reuses them). These tests run many fits in one process, so each ends by releasing them.

The checkpoint tests here use ``checkpoint_format`` (tests/checkpoint/conftest.py) to run against both on-disk formats."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests.checkpoint.conftest import checkpoint_format  # noqa: F401 - the checkpoint tests' format fixture

_LIGHTNING_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")


@pytest.fixture(autouse=True)
def _release_lightning_process_group():
    before = {k: os.environ.get(k) for k in _LIGHTNING_ENV}
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
