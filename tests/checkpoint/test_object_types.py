"""Objects in a checkpoint folder (2+ processes) come back as the types ``torch.load`` gives back for a Lightning file.

The oracle is ``torch.save``/``torch.load(weights_only=True)`` of the same dict with the same allowed globals: what
``DDPStrategy``'s rank-0 file gives back. A folder keeps its non-tensor state as JSON (the JSON codec); a ``Counter``,
``OrderedDict``, ``frozenset`` and an allowed namedtuple come back as themselves on every rank, and with
``weights_only=False`` an object that is not an allowed global loads as ``torch.load(weights_only=False)`` loads it.
"""

from __future__ import annotations

import io
from collections import Counter, OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch

from lightning_ft.checkpoint import AsyncCheckpointer, UnsafeCheckpointError, load_checkpoint
from tests.helpers import run_distributed

Point = namedtuple("Point", "x y")


class Encoder:
    """A class that is not an allowed global (pytorch-forecasting's encoders in hyperparameters)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


def _state(rank: int) -> dict:
    return {
        "state_dict": OrderedDict([("w", torch.arange(4.0))]),
        "counts": Counter(batches=3 + rank),
        "point": Point(1, torch.ones(2)),
        "tags": frozenset({"a", "b"}),
        "encoder": Encoder(2.5),
    }


def _types(value: dict) -> dict:
    return {k: type(v) for k, v in value.items() if k != "encoder"}


def _oracle(rank: int) -> dict:
    buffer = io.BytesIO()
    torch.save(_state(rank), buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([Point, frozenset]):
        return _types(torch.load(buffer, weights_only=False))


def _save_and_load(rank: int, world_size: int, folder: str) -> None:
    path = Path(folder) / "epoch=0-step=1.ckpt"
    writer = AsyncCheckpointer()
    writer.save(path, _state(0), rank_state={"mine": _state(rank)["counts"]}, metadata={"step": 1})
    writer.close()
    with torch.serialization.safe_globals([Point, frozenset]):
        with pytest.raises(UnsafeCheckpointError, match="Encoder"):
            load_checkpoint(path)
        loaded = load_checkpoint(path, weights_only=False)
    assert _types(loaded.state) == _oracle(rank)
    assert loaded.state["counts"]["batches"] == 3 and loaded.state["point"].x == 1
    assert type(loaded.rank_state["mine"]) is Counter and loaded.rank_state["mine"]["batches"] == 3 + rank
    assert type(loaded.state["encoder"]) is Encoder and loaded.state["encoder"].scale == 2.5


def test_objects_come_back_as_their_types_on_one_process(tmp_path):
    _save_and_load(0, 1, str(tmp_path))


def test_objects_come_back_as_their_types_on_two_processes(tmp_path):
    run_distributed(_save_and_load, 2, str(tmp_path), timeout_s=180)


def test_a_namedtuple_that_is_not_allowed_comes_back_as_a_tuple_with_the_code_that_allows_it(tmp_path):
    path = tmp_path / "c.ckpt"
    writer = AsyncCheckpointer()
    writer.save(path, {"point": Point(1, 2)}, metadata={"step": 1})
    writer.close()
    with pytest.warns(UserWarning, match=r"Point.*add_safe_globals\(\[tests\.checkpoint\.test_object_types\.Point\]\)"):
        loaded = load_checkpoint(path)
    assert type(loaded.state["point"]) is tuple and loaded.state["point"] == (1, 2)
