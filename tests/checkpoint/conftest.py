"""The checkpoint tests run against both on-disk formats behind the storage seam.

A test (or a whole module, with ``pytestmark = pytest.mark.usefixtures("checkpoint_format")``) that uses the
``checkpoint_format`` fixture runs once per format of :data:`~lightning_ft.checkpoint.storage.FORMATS`. For its
duration every storage made without an explicit one writes that format: ``AsyncCheckpointer()``, the strategy's writer
(``ElasticFT3D()`` keeps its default ``checkpoint_format`` argument and writes the format under test) and the fakes of
tests/checkpoint/support.py. Readers need nothing: loading recognizes the format from the folder.

Processes started by a test (``run_distributed``, torchrun) do not see the switch; those tests pass the format on.
"""

from __future__ import annotations

import pytest

from lightning_ft.checkpoint import async_checkpointer
from lightning_ft.checkpoint.internal import FORMATS, storage_named
from lightning_ft.strategy import checkpoint_io
from tests.checkpoint import support


def use_checkpoint_format(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``name`` the format every storage created without an explicit one writes, until the test ends."""
    monkeypatch.setattr(support, "_format", [name])
    monkeypatch.setattr(async_checkpointer, "SnapshotStorage", support.format_storage)

    def strategy_storage(format_name: str, **kwargs):
        # ElasticFT3D() resolves its default "auto" (to "file" in one process); an explicit "dcp" stays "dcp".
        return storage_named(name if format_name in ("torchsnapshot", "auto", "file") else format_name, **kwargs)

    monkeypatch.setattr(checkpoint_io, "storage_named", strategy_storage)


@pytest.fixture(params=[name for name in FORMATS if name != "auto"])  # "auto" writes one of the others
def checkpoint_format(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The on-disk format this run of the test writes: ``"torchsnapshot"``, ``"dcp"``, then ``"file"`` (a world of one
    process; tests of folder internals or of several processes skip it with :func:`~tests.checkpoint.support.folders_only`)."""
    use_checkpoint_format(request.param, monkeypatch)
    return request.param
