"""The JSON codec stores non-tensor checkpoint state in a plain format and restores it without unpickling."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import io
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_ft.checkpoint import CorruptCheckpointError, UnsafeCheckpointError, json_codec


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class HParams:
    lr: float
    layers: tuple[int, ...]


class Opaque:
    """A class of the user's with no plain encoding."""

    def __init__(self, value: int = 1) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other.value == self.value


class Payload:
    """What a tampered checkpoint would hold: unpickling it runs a command."""

    def __reduce__(self):
        return (os.system, ("echo unpickled",))


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
    assert out["hp"] == HParams(lr=0.5, layers=(1, 2)) and type(out["hp"]) is HParams
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


def test_an_object_of_a_class_not_allowed_is_stored_with_a_warning_and_refused_at_decode_until_allowed():
    # Contract since issue 22 (0.2.0 stored a repr() string, which came back as that string). The save never fails for
    # it (invariant 2); the warning names the key and the fix, and the load needs the class allowed.
    with pytest.warns(
        UserWarning, match=r"hparams/thing is a tests\.checkpoint\.test_json_codec\.Opaque.*add_safe_globals"
    ):
        encoded = json.loads(json.dumps(json_codec.encode({"hparams": {"thing": Opaque(3)}})))
    with pytest.raises(UnsafeCheckpointError, match=r"hparams/thing: .*Opaque.*add_safe_globals"):
        json_codec.decode(encoded)
    with torch.serialization.safe_globals([Opaque]):
        out = json_codec.decode(encoded)
    assert type(out["hparams"]["thing"]) is Opaque and out["hparams"]["thing"] == Opaque(3)


def test_an_object_whose_pickle_torch_cannot_scan_is_stored_with_a_warning_and_refused_at_decode():
    # A tuple that refers back to itself through an object pickles with POP, an opcode torch's scan of the globals
    # does not read; the save must not fail for it (invariant 2), as torch.save does not.
    inner = Opaque(5)
    cycle = (inner,)
    inner.cycle = cycle
    thing = Opaque(cycle)
    with pytest.warns(UserWarning, match=r"hparams/cycle is a tests\.checkpoint.*restricted unpickler cannot read"):
        encoded = json.loads(json.dumps(json_codec.encode({"hparams": {"cycle": thing}})))
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError), match=r"hparams/cycle"):
        json_codec.decode(encoded)


def test_an_object_that_cannot_be_pickled_fails_at_encode_naming_its_key():
    with pytest.raises(TypeError, match=r"hparams/fn: .*cannot be pickled"):
        json_codec.encode({"hparams": {"fn": lambda x: x}})


def test_an_object_of_an_allowed_class_comes_back_equal_and_of_its_class():
    with torch.serialization.safe_globals([Opaque]):
        out = roundtrip({"thing": Opaque(7), "loss": None})
    assert type(out["thing"]) is Opaque and out["thing"] == Opaque(7)


def test_an_nn_module_comes_back_with_its_parameters():
    module = torch.nn.Linear(3, 2)
    with torch.serialization.safe_globals([torch.nn.Linear]):
        out = roundtrip({"head": module})
    assert type(out["head"]) is torch.nn.Linear
    assert torch.equal(out["head"].weight, module.weight) and torch.equal(out["head"].bias, module.bias)


def test_an_allowed_object_is_refused_at_decode_where_its_class_is_not_allowed():
    with torch.serialization.safe_globals([Opaque]):
        encoded = json.loads(json.dumps(json_codec.encode({"thing": Opaque()})))
    with pytest.raises(UnsafeCheckpointError, match=r"thing: .*Opaque"):
        json_codec.decode(encoded)


def _with_payload(encoded, data: bytes):
    encoded["thing"]["data"] = base64.b64encode(data).decode("ascii")
    return encoded


def test_a_tampered_payload_is_refused_at_decode_without_running_it(capfd):
    with torch.serialization.safe_globals([Opaque]):
        encoded = json.loads(json.dumps(json_codec.encode({"thing": Opaque()})))
        malicious = io.BytesIO()
        torch.save(Payload(), malicious)
        with pytest.raises(UnsafeCheckpointError, match=r"thing: .*system"):
            json_codec.decode(_with_payload(encoded, malicious.getvalue()))
        flipped = bytearray(base64.b64decode(encoded["thing"]["data"]))
        flipped[len(flipped) // 2] ^= 0xFF
        with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
            json_codec.decode(_with_payload(encoded, bytes(flipped)))
    assert "unpickled" not in capfd.readouterr().out


def test_a_dataclass_whose_class_is_not_imported_is_restored_as_its_fields_with_a_warning():
    encoded = json.loads(json.dumps(json_codec.encode(HParams(lr=0.5, layers=(1,)))))
    encoded["type"] = "not_imported_module.HParams"
    with pytest.warns(UserWarning, match="not_imported_module.HParams"):
        assert json_codec.decode(encoded) == {"lr": 0.5, "layers": (1,)}


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


def _sparse_examples() -> dict[str, torch.Tensor]:
    dense = torch.tensor([[0.0, 1.5, 0.0, 0.0], [2.0, 0.0, 0.0, -3.0], [0.0, 0.0, 0.0, 0.0], [4.0, 0.0, 5.0, 0.0]])
    uncoalesced = torch.sparse_coo_tensor([[0, 0, 1], [1, 1, 0]], [1.0, 2.0, 3.0], (2, 2))
    hybrid = torch.sparse_coo_tensor([[0, 2]], torch.arange(6.0).reshape(2, 3), (4, 3))  # a dense trailing dim
    return {
        "coo": dense.to_sparse(),
        "uncoalesced": uncoalesced,
        "hybrid": hybrid,
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "bsr": dense.to_sparse_bsr((2, 2)),
        "bsc": dense.to_sparse_bsc((2, 2)),
        "int_csr": dense.to(torch.int64).to_sparse_csr(),
    }


def test_sparse_tensors_are_saved_and_restored_with_their_layout_and_values(tmp_path):
    from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint

    state = {"embedding": _sparse_examples(), "dense": torch.ones(3)}
    rank_state = {"mask": torch.eye(3).to_sparse()}
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(tmp_path / "c", state, rank_state=rank_state, metadata={"step": 1})
    finally:
        checkpointer.close()
    loaded = load_checkpoint(tmp_path / "c")
    for name, expected in _sparse_examples().items():
        restored = loaded.state["embedding"][name]
        assert restored.layout == expected.layout and restored.dtype == expected.dtype, name
        assert restored.shape == expected.shape, name
        assert torch.equal(restored.to_dense(), expected.to_dense()), name
    assert loaded.rank_state["mask"].layout == torch.sparse_coo
    assert torch.equal(loaded.rank_state["mask"].to_dense(), torch.eye(3))


def test_tensors_without_plain_bytes_are_refused_at_the_save_call_naming_their_key(tmp_path):
    from lightning_ft.checkpoint import AsyncCheckpointer

    refused = {
        "quantized": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
        "on_meta": torch.empty(4, device="meta"),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    }
    checkpointer = AsyncCheckpointer()
    try:
        for name, tensor in refused.items():
            with pytest.raises(TypeError, match=f"model/{name}"):
                checkpointer.save(tmp_path / name, {"model": {name: tensor, "ok": torch.ones(2)}})
            assert not (tmp_path / name).exists()  # refused before any work
    finally:
        checkpointer.close()


def test_a_class_torch_finds_only_while_loading_is_named_in_the_refusal():
    # numpy's dtype classes (an object array in a scaler's state, say) are not GLOBAL opcodes: torch's unpickler names
    # them only when it is asked to build one.
    value = {"table": np.array([1, "x"], dtype=object)}
    with pytest.warns(UserWarning):
        encoded = json.loads(json.dumps(json_codec.encode(value)))
    with pytest.raises(UnsafeCheckpointError, match=r"table: .*numpy"):
        json_codec.decode(encoded)
