"""The content checksums of a checkpoint file (lightning_ft/checkpoint/file_checks.py) tell an edit from the saved
content: an object that is loaded back unchanged counts as unchanged, whatever it holds."""

from __future__ import annotations

import io
import pickle
import zlib

import torch
from torch import nn

from lightning_ft.checkpoint.file_checks import content_checksums


class Metric(nn.Module):
    """A library's metric kept in the hyperparameters (chemprop keeps its metrics and predictor there): an nn.Module
    with a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("task_weights", torch.ones(1, 3))


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_an_object_holding_tensors_has_the_same_checksums_after_torch_save_and_load():
    checkpoint = {"state_dict": {"w": torch.arange(4.0)}, "hyper_parameters": {"metrics": [Metric()], "lr": 0.1}}
    assert content_checksums(_round_trip(checkpoint)) == content_checksums(checkpoint)


def test_a_changed_tensor_inside_an_object_changes_the_checksums():
    checkpoint = {"hyper_parameters": {"metrics": [Metric()]}}
    edited = _round_trip(checkpoint)
    edited["hyper_parameters"]["metrics"][0].task_weights[0, 1] = 2.0
    assert content_checksums(edited) != content_checksums(checkpoint)


class Plain:
    def __init__(self) -> None:
        self.name, self.sizes = "x", (1, 2)


def test_an_object_without_tensors_counts_as_before():
    # Files written before an object's tensors were counted by their bytes keep matching their recorded checksums.
    checkpoint = {"hyper_parameters": {"encoder": Plain()}}
    parts = [b"builtins.dict:", b"'hyper_parameters'=", b"builtins.dict:", b"'encoder'=", b"tests.checkpoint."]
    recorded_before = zlib.crc32(
        b"\x00".join(
            [
                *parts[:4],
                f"{Plain.__module__}.Plain:".encode(),
                zlib.crc32(pickle.dumps(checkpoint["hyper_parameters"]["encoder"], protocol=4)).to_bytes(4, "little"),
                b"}",
                b"}",
            ]
        )
    )
    assert content_checksums(checkpoint)["objects"] == recorded_before
