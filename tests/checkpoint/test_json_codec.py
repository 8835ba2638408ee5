"""The JSON codec stores non-tensor checkpoint state in a plain format and restores it without unpickling."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_ft.checkpoint import json_codec


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class HParams:
    lr: float
    layers: tuple[int, ...]


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


def roundtrip(obj):
    return json_codec.decode(json.loads(json.dumps(json_codec.encode(obj), allow_nan=False)))


def test_optimizer_state_with_int_keys_round_trips():
    state = {0: {"step": 3, "betas": (0.9, 0.999)}, 1: {"step": 4, "betas": (0.8, 0.99)}}
    assert roundtrip(state) == state


def test_numpy_rng_state_round_trips_exactly_and_reproduces_the_stream():
    rng = np.random.RandomState(1234)
    rng.standard_normal(7)  # leave a cached gaussian and a position in the state
    restored = np.random.RandomState()
    restored.set_state(roundtrip(rng.get_state()))
    assert np.array_equal(rng.standard_normal(5), restored.standard_normal(5))


def test_python_rng_state_round_trips():
    state = random.Random(7).getstate()
    restored = random.Random()
    restored.setstate(roundtrip(state))
    assert restored.random() == random.Random(7).random()


def test_namespace_dataclass_path_enum_set_and_special_floats_round_trip():
    value = {
        "ns": argparse.Namespace(lr=0.1, name="x"),
        "hp": HParams(lr=0.5, layers=(1, 2)),
        "path": Path("/tmp/data"),
        "color": Color.RED,
        "tags": {"a", "b"},
        "nan": float("nan"),
        "inf": float("-inf"),
        "scalar": np.float32(1.5),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "blob": b"\x00\xff",
    }
    out = roundtrip(value)
    assert out["ns"] == argparse.Namespace(lr=0.1, name="x")
    assert out["hp"] == {"lr": 0.5, "layers": (1, 2)}
    assert out["path"] == Path("/tmp/data")
    assert out["color"] is Color.RED
    assert out["tags"] == {"a", "b"}
    assert math.isnan(out["nan"]) and out["inf"] == float("-inf")
    assert out["scalar"] == np.float32(1.5) and out["scalar"].dtype == np.float32
    assert out["dtype"] is torch.bfloat16
    assert out["size"] == (2, 3)
    assert out["blob"] == b"\x00\xff"


def test_a_user_dict_using_the_reserved_tag_key_survives():
    value = {json_codec.TAG: "tensor", "key": "not a reference"}
    assert roundtrip(value) == value


def test_unknown_objects_are_stored_as_a_tagged_repr_with_a_warning():
    with pytest.warns(UserWarning, match="Opaque"):
        encoded = json_codec.encode({"thing": Opaque()})
    assert json_codec.decode(encoded) == {"thing": "Opaque()"}


def test_tensors_are_replaced_by_references_and_resolved_on_decode():
    tensors = {}

    def store(tensor, path):
        tensors[path] = tensor
        return path

    value = {"model": {"w": torch.ones(2)}, "groups": [torch.zeros(1)]}
    encoded = json_codec.encode(value, store)
    assert set(tensors) == {"model/w", "groups/0"}
    decoded = json_codec.decode(encoded, lambda key, path: tensors[key])
    assert decoded["model"]["w"] is tensors["model/w"]


def test_a_tensor_where_none_is_allowed_is_a_type_error():
    with pytest.raises(TypeError, match="metadata/x"):
        json_codec.encode({"x": torch.ones(1)}, None, "metadata")
