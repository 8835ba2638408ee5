"""Suite-wide hygiene: a test that leaks a process group, a thread or an environment variable fails."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest):
    env_before = dict(os.environ)
    threads_before = set(threading.enumerate())
    yield
    problems = []
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        problems.append("a process group was left initialized")
    # Lightning and torch set a few variables on purpose; only the ones tests would leak are checked.
    leaked_env = {
        k
        for k in set(os.environ) - set(env_before)
        if k.startswith(("LIGHTNING_FT", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC"))
    }
    for k in leaked_env:
        del os.environ[k]
    if leaked_env:
        problems.append(f"environment variables leaked: {sorted(leaked_env)}")
    ours = [t for t in set(threading.enumerate()) - threads_before if t.name.startswith("lightning-ft")]
    for t in ours:
        t.join(timeout=5)
    leaked_threads = [t.name for t in ours if t.is_alive()]
    if leaked_threads:
        problems.append(f"threads leaked: {leaked_threads}")
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_process():
    torch.set_num_threads(1)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def event_log_on_disk(monkeypatch):
    """Keep the event log on disk in a plain one-process run (``LIGHTNING_FT_EVENT_LOG=always``), for a test that
    reads it: without a monitor, torchrun or an incident such a run keeps it in memory (lightning_ft/events.py)."""
    monkeypatch.setenv("LIGHTNING_FT_EVENT_LOG", "always")


_LIGHTNING_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")


@pytest.fixture
def release_lightning_process_group():
    """An in-process ``Trainer`` stage leaves Lightning's process group and its rendezvous variables up, on purpose (a
    second ``fit`` reuses them): released after the test, the variables as they were before it."""
    before = {k: os.environ.get(k) for k in _LIGHTNING_ENV}
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
