"""What a checkpoint holds, and a one-file export of it, for the ``lightning-ft inspect`` and ``export`` commands.

:func:`describe` reports step, world size, mesh, bytes, whether the checkpoint is committed, whether its shards cover
every tensor of its index, and whether every shard matches its checksum (it reads all the data). :func:`export_state_dict` assembles the full model tensors from their shards
into one plain ``torch.save`` file that ``LightningModule.load_from_checkpoint`` and ``torch.load(weights_only=True)``
both accept, so a checkpoint leaves lightning-ft without it.
"""

from __future__ import annotations

import argparse
import enum
import os
import pathlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.commit import read_document
from lightning_ft.checkpoint.coverage import coverage_problems
from lightning_ft.checkpoint.discovery import is_committed, verify
from lightning_ft.checkpoint.errors import CheckpointError
from lightning_ft.checkpoint.load import load_checkpoint

__all__ = ["describe", "export_state_dict", "exported_checkpoint", "format_description"]

_MODEL_KEYS = ("state_dict", "model")


def _mesh(metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, int] | None:
    for key in ("mesh", "mesh_shape"):
        if key in metadata:
            return metadata[key]
    for record in tensors.values():
        if record.get("kind") == "dtensor":
            names = record.get("mesh_dim_names") or [f"dim{i}" for i in range(len(record["mesh_shape"]))]
            return dict(zip(names, record["mesh_shape"], strict=False))
    return None


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """A summary of checkpoint ``path``: always ``path``, ``committed``, ``checksums_ok`` (no problem found at all) and
    ``problems``; plus ``format_version``, ``step``, ``full_state``, ``epoch``, ``world_size``, ``mesh``, ``size_bytes``,
    ``tensors``, ``shards`` and ``coverage_ok`` (the shards cover every tensor of the index) when the metadata is
    readable. Reads every shard to check checksums. Not collective.
    """
    path = Path(path)
    problems = verify(path)
    desc: dict[str, Any] = {
        "path": str(path),
        "committed": is_committed(path),
        "checksums_ok": not problems,
        "problems": problems,
    }
    try:
        document = read_document(path, require_commit=False)
    except CheckpointError:
        return desc
    metadata = json_codec.decode(document["metadata"])
    tensors = document["tensors"]
    desc.update(
        format_version=document["format_version"],
        step=metadata.get("step"),
        full_state=metadata.get("full_state"),
        epoch=metadata.get("epoch"),
        world_size=metadata.get("world_size"),
        mesh=_mesh(metadata, tensors),
        size_bytes=metadata.get("size_bytes"),
        tensors=len(tensors),
        shards=sum(len(r["shards"]) for r in tensors.values()),
        coverage_ok=not coverage_problems(document),
    )
    return desc


def format_description(desc: dict[str, Any]) -> str:
    """Human-readable lines for a :func:`describe` result."""
    lines = [f"checkpoint      {desc['path']}", f"committed       {'yes' if desc['committed'] else 'NO'}"]
    labels = [
        ("format_version", "format version"),
        ("step", "step"),
        ("full_state", "full state"),
        ("epoch", "epoch"),
        ("world_size", "world size"),
        ("mesh", "mesh"),
        ("size_bytes", "bytes"),
        ("tensors", "tensors"),
        ("shards", "shards"),
    ]
    for key, label in labels:
        if key in desc and not (key == "full_state" and desc[key] is None):
            value = desc[key]
            if key == "size_bytes" and isinstance(value, int):
                value = f"{value} ({value / 2**20:.1f} MiB)"
            lines.append(f"{label:<15} {value}")
    if "coverage_ok" in desc:
        lines.append(f"coverage        {'ok' if desc['coverage_ok'] else 'INCOMPLETE (cannot load)'}")
    lines.append(f"checksums       {'ok' if desc['checksums_ok'] else 'FAILED'}")
    lines += [f"  problem: {p}" for p in desc["problems"]]
    return "\n".join(lines)


def _plain(obj: Any) -> Any:
    """Values that ``torch.load(weights_only=True)`` accepts: containers, primitives, tensors."""
    if isinstance(obj, (str, int, float, bool, type(None), torch.Tensor)):
        return obj
    if isinstance(obj, argparse.Namespace):
        return _plain(vars(obj))
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if isinstance(obj, enum.Enum):
        return _plain(obj.value)
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def exported_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Committed checkpoint ``path`` as one plain Lightning checkpoint dict, in memory.

    It holds ``state_dict`` (full model tensors, assembled from their shards, on CPU), ``hyper_parameters``,
    ``pytorch-lightning_version``, ``epoch`` and ``global_step`` (and ``hparams_name`` when saved): what
    ``LightningModule.load_from_checkpoint`` reads. Not collective: one process reads every shard it needs.

    Raises:
        CheckpointError: as :func:`load_checkpoint`, or the checkpoint holds no model state (no ``state_dict`` key).
    """
    import lightning

    loaded = load_checkpoint(path, collective=False)
    state = loaded.state if isinstance(loaded.state, dict) else {}
    model = next((state[k] for k in _MODEL_KEYS if isinstance(state.get(k), dict)), None)
    metadata = loaded.metadata
    if model is None:
        mesh = metadata.get("mesh") or {}
        why = (
            "a pipeline-parallel checkpoint keeps each stage's weights with the ranks of that stage"
            if (mesh.get("pipeline_parallel") or 1) > 1
            else f"looked for keys {list(_MODEL_KEYS)}"
        )
        raise CheckpointError(f"checkpoint {path}: no model state found ({why})")
    exported = {
        "state_dict": {str(k): v for k, v in model.items() if isinstance(v, torch.Tensor)},
        "hyper_parameters": _plain(state.get("hyper_parameters", metadata.get("hyper_parameters", {}))),
        "pytorch-lightning_version": str(state.get("pytorch-lightning_version", lightning.__version__)),
        "epoch": _plain(state.get("epoch", metadata.get("epoch", 0))),
        "global_step": _plain(state.get("global_step", metadata.get("step", 0))),
    }
    if "hparams_name" in state:
        exported["hparams_name"] = _plain(state["hparams_name"])
    return exported


def export_state_dict(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write committed checkpoint ``path`` as one plain ``torch.save`` file at ``out``; returns ``out``.

    The file holds what :func:`exported_checkpoint` returns. Not collective: run it in one process (any rank may).

    Raises:
        CheckpointError: as :func:`exported_checkpoint`.
    """
    exported = exported_checkpoint(path)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    torch.save(exported, tmp)
    os.replace(tmp, out)
    return out
