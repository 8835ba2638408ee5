"""Plain JSON encoding for the non-tensor part of a checkpoint.

A checkpoint's nested state (Lightning's checkpoint dict, optimizer state, RNG states, callback states) is split in two:
tensors go to torchsnapshot as flat entries, everything else goes through this codec into the checkpoint's metadata JSON,
with each tensor replaced by a reference ``{"__lft__": "tensor", "key": ...}``.

Supported beyond plain JSON: dicts with non-string keys (optimizer state uses ``int`` keys), tuples, sets and
frozensets, dict and tuple subclasses (``OrderedDict``, ``Counter``, namedtuples: restored as themselves where
``torch.load(weights_only=True)`` would restore them, see :func:`_as_type`; a dict subclass with its instance
attributes, as pickle keeps them, such as the ``_metadata`` of a module's ``state_dict``), ``float``
nan/inf, ``bytes``, numpy arrays and scalars (bit-exact, so ``np.random.get_state()`` round-trips), ``argparse.Namespace``,
dataclass instances and enums (restored as themselves when their class is already imported where the checkpoint is
read, else as a dict of their fields or their value, with a warning), ``pathlib.Path``, ``torch.dtype``,
``torch.device`` and ``torch.Size``.

Every other object is stored with ``torch.save`` (:func:`~lightning_ft.checkpoint.safe_load.pickled_bytes`: a save
never fails for its class; a warning names the key when its class is not allowed yet) and comes back as itself through
torch's restricted unpickler, which admits only allowed globals (``torch.serialization.add_safe_globals``); a load that
would need any other global is refused, naming the key. Loading unpickles nothing else, unless the load was asked
for with ``weights_only=False`` (:func:`~lightning_ft.checkpoint.safe_load.weights_only_scope`), as Lightning's is.

A sparse tensor (COO, CSR, CSC, BSR, BSC) is stored as its dense parts (indices and values, each handed to
``on_tensor``) plus its layout and size, and comes back as a sparse tensor of the same layout, checked for the sparse
invariants. An uncoalesced COO tensor is stored coalesced (duplicate entries summed: the same tensor value).
"""

from __future__ import annotations

import argparse
import base64
import contextvars
import dataclasses
import enum
import io
import math
import pathlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lightning_ft import _compat
from lightning_ft.checkpoint.safe_load import (
    allow_code,
    default_safe_globals,
    load_pickled,
    pickled_bytes,
    unrestricted,
)

TAG = "__lft__"
"""The key that marks an encoded non-JSON value; a user dict holding this key is encoded in the tagged item form."""

_SPARSE_LAYOUTS = {
    torch.sparse_coo: "coo",
    torch.sparse_csr: "csr",
    torch.sparse_csc: "csc",
    torch.sparse_bsr: "bsr",
    torch.sparse_bsc: "bsc",
}
_LAYOUTS_BY_NAME = {name: layout for layout, name in _SPARSE_LAYOUTS.items()}

EncodeTensor = Callable[[torch.Tensor, str], str]
"""``(tensor, path) -> key``: stores the tensor elsewhere and returns the reference key written into the JSON."""
DecodeTensor = Callable[[str, str], Any]
"""``(key, path) -> value``: resolves a tensor reference while decoding."""


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _path_join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def encode(obj: Any, on_tensor: EncodeTensor | None = None, path: str = "") -> Any:
    """Encode ``obj`` into JSON-compatible values; tensors are handed to ``on_tensor`` (an error if it is ``None``).

    ``path`` is the slash-joined location of ``obj`` in the enclosing structure; it becomes the tensors' default key and
    appears in warnings.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return {TAG: "enum", "type": _qualname(obj), "value": encode(obj.value, on_tensor, path)}
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {TAG: "float", "value": repr(obj)}
    if isinstance(obj, torch.Tensor):
        if on_tensor is None:
            raise TypeError(
                f"{path or 'value'}: tensors are not allowed here (got a tensor of shape {list(obj.shape)})"
            )
        if obj.layout != torch.strided:
            return _encode_sparse(obj, on_tensor, path)
        return {TAG: "tensor", "key": on_tensor(obj, path)}
    if isinstance(obj, dict):
        subclass = type(obj) is not dict
        if all(isinstance(k, str) for k in obj) and TAG not in obj and not subclass:
            return {k: encode(v, on_tensor, _path_join(path, k)) for k, v in obj.items()}
        items = [[encode(k, None, path), encode(v, on_tensor, _path_join(path, k))] for k, v in obj.items()]
        # A subclass's own attributes, as pickle keeps them: a module's state_dict (an OrderedDict) carries the module
        # versions its load reads in `_metadata`.
        attributes = getattr(obj, "__dict__", None) if subclass else None
        return {
            TAG: "dict",
            "items": items,
            **({"type": _qualname(obj)} if subclass else {}),
            **({"attributes": encode(dict(attributes), on_tensor, _path_join(path, "__dict__"))} if attributes else {}),
        }
    if isinstance(obj, list):
        return [encode(v, on_tensor, _path_join(path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, torch.Size):
        return {TAG: "tuple", "items": [int(v) for v in obj]}
    if isinstance(obj, tuple):
        items = [encode(v, on_tensor, _path_join(path, i)) for i, v in enumerate(obj)]
        return {TAG: "tuple", "items": items, **({"type": _qualname(obj)} if type(obj) is not tuple else {})}
    if isinstance(obj, (set, frozenset)):
        items = [encode(v, None, path) for v in obj]
        return {
            TAG: "set",
            "items": sorted(items, key=repr),
            **({"frozen": True} if isinstance(obj, frozenset) else {}),
        }
    if isinstance(obj, bytes):
        return {TAG: "bytes", "data": _b64(obj)}
    if isinstance(obj, np.ndarray) and obj.dtype != object:
        data = np.ascontiguousarray(obj)
        return {TAG: "ndarray", "dtype": data.dtype.str, "shape": list(data.shape), "data": _b64(data.tobytes())}
    if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
        return {TAG: "npscalar", "dtype": obj.dtype.str, "data": _b64(obj.tobytes())}
    if isinstance(obj, argparse.Namespace):
        return {TAG: "namespace", "fields": encode(vars(obj), on_tensor, path)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        fields.update(getattr(obj, "__dict__", {}))  # attributes set in __post_init__ too
        return {TAG: "dataclass", "type": _qualname(obj), "fields": encode(fields, on_tensor, path)}
    if isinstance(obj, pathlib.PurePath):
        return {TAG: "path", "value": str(obj)}
    if isinstance(obj, torch.dtype):
        return {TAG: "dtype", "value": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {TAG: "device", "value": str(obj)}
    # No stand-in (a repr would come back as a string): the object itself, loaded back once its class is allowed.
    data = pickled_bytes(obj, path or "value")
    return {TAG: "pickle", "type": _qualname(obj), "data": _b64(data)}


def _sparse_parts(tensor: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    if layout == "coo":
        tensor = tensor.coalesce()  # indices() exists only on a coalesced tensor
        return {"indices": tensor.indices(), "values": tensor.values()}
    if layout in ("csr", "bsr"):
        return {
            "compressed_indices": tensor.crow_indices(),
            "plain_indices": tensor.col_indices(),
            "values": tensor.values(),
        }
    return {
        "compressed_indices": tensor.ccol_indices(),
        "plain_indices": tensor.row_indices(),
        "values": tensor.values(),
    }


def _encode_sparse(tensor: torch.Tensor, on_tensor: EncodeTensor, path: str) -> dict[str, Any]:
    layout = _SPARSE_LAYOUTS.get(tensor.layout)
    if layout is None:
        raise TypeError(
            f"{path or 'value'}: a tensor with layout {tensor.layout} cannot be checkpointed; store it as a dense or "
            "sparse (COO, CSR, CSC, BSR, BSC) tensor"
        )
    parts = _sparse_parts(tensor.detach(), layout)
    refs = {name: {TAG: "tensor", "key": on_tensor(part, f"{path}@{name}")} for name, part in parts.items()}
    return {TAG: "sparse", "layout": layout, "size": list(tensor.shape), "parts": refs}


def _decode_sparse(obj: dict[str, Any], on_tensor: DecodeTensor | None, path: str) -> Any:
    parts = {name: decode(ref, on_tensor, f"{path}@{name}") for name, ref in obj["parts"].items()}
    if on_tensor is None:
        return parts  # tensor references kept as keys, as for dense tensors
    layout, size = obj["layout"], obj["size"]
    if layout == "coo":
        return torch.sparse_coo_tensor(
            parts["indices"], parts["values"], size, is_coalesced=True, check_invariants=True
        )
    if layout not in _LAYOUTS_BY_NAME:
        raise ValueError(f"{path or 'value'}: unknown sparse layout {layout!r} (written by a newer lightning-ft?)")
    return torch.sparse_compressed_tensor(
        parts["compressed_indices"],
        parts["plain_indices"],
        parts["values"],
        size,
        layout=_LAYOUTS_BY_NAME[layout],
        check_invariants=True,
    )


def _imported_class(type_name: str) -> Any:
    # Only classes already imported are used: resolving a name never imports code (that would be unpickling by another
    # name).
    module_name, _, qualname = type_name.rpartition(".")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _decode_enum(type_name: str, value: Any, path: str) -> Any:
    cls = _imported_class(type_name)
    if cls is not None and issubclass(cls, enum.Enum):
        try:
            return cls(value)
        except ValueError:
            pass
    warnings.warn(
        f"lightning-ft checkpoint: {path or 'value'} is a {type_name}, which is not imported (or has no member"
        f" {value!r}) where the checkpoint is read; restored as its value. Import the class before loading",
        stacklevel=3,
    )
    return value


def _decode_dataclass(type_name: str, fields: dict[str, Any], path: str) -> Any:
    cls = _imported_class(type_name)
    if cls is None or not dataclasses.is_dataclass(cls):
        warnings.warn(
            f"lightning-ft checkpoint: {path or 'value'} is a {type_name}, which is not imported where the checkpoint"
            " is read; restored as a dict of its fields. Import the class before loading",
            stacklevel=3,
        )
        return fields
    # As unpickling does: the fields are set, neither __init__ nor __post_init__ runs.
    instance = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(instance, name, value)
    return instance


def _allowed(cls: type, type_name: str) -> bool:
    """Whether ``torch.load(weights_only=True)`` would give ``cls`` back in this process (torch's own list, the
    globals the user allowed, lightning-ft's defaults), or the load is not restricted."""
    if _own_pickles.get() or unrestricted():
        return True
    if type_name in _compat.torch_default_safe_globals():
        return True
    for entry in [*torch.serialization.get_safe_globals(), *default_safe_globals()]:
        if entry is cls or (isinstance(entry, tuple) and entry[0] is cls and entry[1] == type_name):
            return True
    return False


_warned_types: set[str] = set()


def _as_type(type_name: str | None, value: Any, base: type, path: str) -> Any:
    """``value`` (a dict or tuple) as the subclass ``type_name`` it was saved as (``OrderedDict``, ``Counter``, a
    namedtuple, ``AttributeDict``), built as unpickling builds it (``__new__``, then the items; no ``__init__``), where
    ``torch.load(weights_only=True)`` would give that class back: already imported and allowed (torch's own list, or
    ``torch.serialization.add_safe_globals``), or with ``weights_only=False``. Otherwise the plain ``base`` value,
    with a warning (once per class) that prints how to allow it."""
    if type_name is None:
        return value
    cls = _imported_class(type_name)
    if cls is not None and issubclass(cls, base) and _allowed(cls, type_name):
        if base is tuple:
            return tuple.__new__(cls, value)
        instance = cls.__new__(cls)
        for key, item in value.items():
            instance[key] = item
        return instance
    if type_name not in _warned_types:
        _warned_types.add(type_name)
        why = "is not imported" if cls is None else "is not an allowed global"
        warnings.warn(
            f"lightning-ft checkpoint: {path or 'value'} is a {type_name}, which {why} where the checkpoint is read;"
            f" restored as a plain {base.__name__} (torch.load(weights_only=True) refuses it too). To get it back as"
            f" itself, import it and allow it before loading: `{allow_code([type_name])}`",
            stacklevel=3,
        )
    return value


_own_pickles: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_ft_own_pickles", default=False)


def decode_own(obj: Any, on_tensor: DecodeTensor | None = None) -> Any:
    """:func:`decode` of what :func:`encode` produced in this process at a save call, never of bytes read back from
    storage: its pickled objects are the user's own objects of that call, pickled a moment ago, so they come back
    whatever their class (the single-file format writes them into the file as Lightning would). Loads of stored
    checkpoints use :func:`decode`, whose unpickling is restricted."""
    token = _own_pickles.set(True)
    try:
        return decode(obj, on_tensor)
    finally:
        _own_pickles.reset(token)


def decode(obj: Any, on_tensor: DecodeTensor | None = None, path: str = "") -> Any:
    """Inverse of :func:`encode`; tensor references are resolved through ``on_tensor`` (kept as keys if ``None``)."""
    if isinstance(obj, list):
        return [decode(v, on_tensor, _path_join(path, i)) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(TAG)
    if tag is None:
        return {k: decode(v, on_tensor, _path_join(path, k)) for k, v in obj.items()}
    if tag == "tensor":
        return obj["key"] if on_tensor is None else on_tensor(obj["key"], path)
    if tag == "dict":
        out = {}
        for k, v in obj["items"]:
            key = decode(k, None, path)
            out[key] = decode(v, on_tensor, _path_join(path, key))
        typed = _as_type(obj.get("type"), out, dict, path)
        if "attributes" in obj and type(typed) is not dict:
            typed.__dict__.update(decode(obj["attributes"], on_tensor, _path_join(path, "__dict__")))
        return typed
    if tag == "tuple":
        items = tuple(decode(v, on_tensor, _path_join(path, i)) for i, v in enumerate(obj["items"]))
        return _as_type(obj.get("type"), items, tuple, path)
    if tag == "set":
        values = {decode(v, None, path) for v in obj["items"]}
        return frozenset(values) if obj.get("frozen") else values
    if tag == "float":
        return float(obj["value"])
    if tag == "bytes":
        return base64.b64decode(obj["data"])
    if tag == "ndarray":
        data = np.frombuffer(base64.b64decode(obj["data"]), dtype=np.dtype(obj["dtype"]))
        return data.reshape(obj["shape"]).copy()
    if tag == "npscalar":
        return np.frombuffer(base64.b64decode(obj["data"]), dtype=np.dtype(obj["dtype"]))[0]
    if tag == "namespace":
        return argparse.Namespace(**decode(obj["fields"], on_tensor, path))
    if tag == "dataclass":
        return _decode_dataclass(obj["type"], decode(obj["fields"], on_tensor, path), path)
    if tag == "path":
        return pathlib.Path(obj["value"])
    if tag == "enum":
        return _decode_enum(obj["type"], decode(obj["value"], None, path), path)
    if tag == "dtype":
        dtype = getattr(torch, obj["value"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{path or 'value'}: unknown torch dtype {obj['value']!r}")
        return dtype
    if tag == "device":
        return torch.device(obj["value"])
    if tag == "sparse":
        return _decode_sparse(obj, on_tensor, path)
    if tag == "pickle":
        data = base64.b64decode(obj["data"])
        if _own_pickles.get():
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        return load_pickled(data, path or "value")
    if tag == "repr":  # written by lightning-ft 0.2.0 and earlier, which stored what it could not encode as a repr
        return obj["repr"]
    raise ValueError(f"{path or 'value'}: unknown encoded type {tag!r} (written by a newer lightning-ft?)")


def tensor_keys(encoded: Any, out: set[str]) -> set[str]:
    """The keys of every tensor ``encoded`` (:func:`encode`'s output) refers to, added to ``out``; returns ``out``."""
    if isinstance(encoded, list):
        for value in encoded:
            tensor_keys(value, out)
    elif isinstance(encoded, dict):
        if encoded.get(TAG) == "tensor":
            out.add(encoded["key"])
        else:
            for value in encoded.values():
                tensor_keys(value, out)
    return out
