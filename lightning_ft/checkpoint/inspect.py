"""What a checkpoint holds, for the ``lightning-ft inspect`` command.

:func:`describe` reports step, world size, mesh, bytes, whether the checkpoint is committed, whether its shards cover
every tensor of its index, and whether every shard matches its checksum (it reads all the data). The export lives in
:mod:`~lightning_ft.checkpoint.export`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.commit import read_document
from lightning_ft.checkpoint.coverage import coverage_problems
from lightning_ft.checkpoint.discovery import is_committed, verify
from lightning_ft.checkpoint.errors import CheckpointError

__all__ = ["describe", "format_description"]


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
    if document.get("file_format", 1) >= 2:  # Lightning's own file: its tensors are those its record checksums
        checked = document.get("checksums", {}).get("tensors", {})
        desc.update(
            format_version=document["format_version"],
            file_format=document["file_format"],
            step=metadata.get("step"),
            full_state=metadata.get("full_state"),
            epoch=metadata.get("epoch"),
            world_size=metadata.get("world_size"),
            mesh=metadata.get("mesh"),
            size_bytes=Path(path).stat().st_size,
            tensors=len(checked),
            shards=len(checked),
        )
        return desc
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
        ("file_format", "file format"),
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
