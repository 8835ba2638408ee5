"""The on-disk contract of a committed checkpoint: metadata file, commit marker, atomic durable writes.

A lightning-ft checkpoint is a torchsnapshot directory plus two files of ours:

- ``lightning_ft_metadata.json``: format version, the run's metadata (step, world size, mesh, ...), the JSON-encoded
  non-tensor state, every rank's ``rank_state``, and the tensor index (dtype, global shape, placements, and per shard:
  writer rank, entry name, offset, shape, byte size, crc32 of the bytes).
- ``lightning_ft.committed``: the commit marker. Rank 0 writes it last, after an exchange showing that every rank's data
  is durable, after the index was checked to cover every tensor, and after the metadata file is durable. It records
  ``format_version``, ``step``, ``full_state`` (whether the checkpoint holds the full training state; absent when the
  writer did not say), ``time`` and the metadata file's crc32, so that listing checkpoints reads only markers and a
  damaged metadata file is detected. A directory without it is never loaded.
- ``lightning_ft.in_progress`` (:mod:`~lightning_ft.checkpoint.in_progress`): present only while a save is written.

Both are written atomically: a temporary file, fsync, ``os.replace``, fsync of the directory.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint.coverage import coverage_problems
from lightning_ft.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    FormatVersionError,
    UncommittedCheckpointError,
)
from lightning_ft.checkpoint.snapshot_storage import fsync_dir

FORMAT_VERSION = 1
"""The checkpoint format this release writes and reads."""
COMMIT_MARKER = "lightning_ft.committed"
"""File name of the commit marker inside a checkpoint directory."""
METADATA_FILE = "lightning_ft_metadata.json"
"""File name of lightning-ft's metadata inside a checkpoint directory."""


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, durably."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_metadata(path: Path, document: dict[str, Any]) -> int:
    """Write the metadata document into checkpoint ``path``; returns the crc32 of the bytes written."""
    data = json.dumps(document, allow_nan=False).encode()
    atomic_write(path / METADATA_FILE, data)
    return zlib.crc32(data)


def write_marker(path: Path, *, step: int | None, metadata_crc32: int, full_state: bool | None = None) -> None:
    """Commit checkpoint ``path``. Call last, once everything else in it is durable."""
    marker: dict[str, Any] = {"format_version": FORMAT_VERSION, "step": step}
    if full_state is not None:
        marker["full_state"] = full_state
    marker.update(time=time.time(), metadata_crc32=metadata_crc32)
    atomic_write(path / COMMIT_MARKER, json.dumps(marker).encode())


def build_document(
    user_metadata: dict[str, Any],
    *,
    step: int | None,
    world_size: int,
    state_json: Any,
    gathered: list[Any],
    name: Any,
) -> tuple[dict[str, Any], int]:
    """The metadata document of a save from every rank's ``(records, known tensors, rank state)``, and its tensor
    bytes: each tensor's index record with the shards every rank wrote.

    Raises:
        CheckpointError: the shards do not cover the index (:func:`~lightning_ft.checkpoint.coverage.coverage_problems`):
            checkpoint ``name`` could not be loaded back, so it must not be committed.
    """
    tensors: dict[str, dict[str, Any]] = {}
    for _, known, _ in gathered:
        for key, record in known.items():
            tensors.setdefault(key, {**record, "shards": []})
    size_bytes = 0
    for records, _, _ in gathered:
        for record in records:
            tensors[record["key"]]["shards"].append({k: v for k, v in record.items() if k != "key"})
            size_bytes += record["nbytes"]
    metadata = {
        **user_metadata,
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "size_bytes": size_bytes,
    }
    document = {
        "format_version": FORMAT_VERSION,
        "metadata": metadata,
        "state": state_json,
        "rank_states": [rank_state for _, _, rank_state in gathered],
        "tensors": tensors,
    }
    problems = coverage_problems(document)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"checkpoint {name} not committed: it could not be loaded back: {'; '.join(problems[:3])}{more}"
        )
    return document, size_bytes


def owned_records(tensors: dict[str, dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Index records of the tensors this rank wrote shards of, and of its per-rank tensors (what a rank other than 0
    sends: rank 0 already knows every shared tensor)."""
    keys = {r["key"] for r in records} | {k for k in tensors if k.startswith("rank_state/")}
    return {k: tensors[k] for k in keys}


def uncommit(path: Path) -> None:
    """Remove the marker first (durably), so a checkpoint being replaced is never seen half-deleted as committed."""
    marker = path / COMMIT_MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(path)


def read_document(path: Path, *, require_commit: bool = True) -> dict[str, Any]:
    """Read and check the metadata document of checkpoint ``path``.

    Raises:
        UncommittedCheckpointError: no marker (with ``require_commit``) or no metadata file.
        CorruptCheckpointError: the marker or the metadata file is unreadable, or the metadata does not match the marker.
        FormatVersionError: the format version is not :data:`FORMAT_VERSION`.
    """
    path = Path(path)
    if path.is_file():
        from lightning_ft.checkpoint.single_file import read_file_document

        return read_file_document(path)  # a checkpoint file holds its marker and document inside
    marker: dict[str, Any] | None = None
    if (path / COMMIT_MARKER).is_file():
        try:
            marker = json.loads((path / COMMIT_MARKER).read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"checkpoint {path}: commit marker {COMMIT_MARKER} is not valid JSON") from e
    elif require_commit:
        raise UncommittedCheckpointError(f"checkpoint {path} has no commit marker {COMMIT_MARKER}")
    meta_file = path / METADATA_FILE
    if not meta_file.is_file():
        raise UncommittedCheckpointError(f"checkpoint {path} has no metadata file {METADATA_FILE}")
    data = meta_file.read_bytes()
    if marker is not None and marker.get("metadata_crc32") not in (None, zlib.crc32(data)):
        raise CorruptCheckpointError(f"checkpoint {path}: {METADATA_FILE} does not match the checksum in its marker")
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        # A pickle (or anything else) in place of our JSON is refused here; nothing is ever unpickled.
        raise CorruptCheckpointError(f"checkpoint {path}: {METADATA_FILE} is not valid JSON ({e})") from e
    if not isinstance(document, dict):
        raise CorruptCheckpointError(f"checkpoint {path}: {METADATA_FILE} does not hold a JSON object")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"checkpoint {path} has format version {version!r}; this lightning-ft reads version {FORMAT_VERSION}"
        )
    return document
