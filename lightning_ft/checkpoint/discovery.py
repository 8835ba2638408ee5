"""Finding, checking and tidying checkpoints in a folder.

Auto-resume and retention use these: :func:`list_committed` and :func:`latest_committed` see only committed
checkpoints (never a link, a placeholder, a half-written save, or the staging and replaced folders of a replacement in
progress), :func:`verify` reads every shard through the :class:`~lightning_ft.checkpoint.shard_reader.ShardReader`,
checks it against the checksums recorded at save and checks that the shards cover every tensor,
:func:`cleanup_uncommitted` settles interrupted replacements and removes the saves of ours that never finished (and
nothing else), and :func:`repoint_last` moves a ``last`` link atomically so it always resolves to a committed
checkpoint (lightning-ft's own ``last`` is a checkpoint of its own; the function serves code that keeps a link).
:func:`newest_alternative` names the newest committed checkpoint next to a refused one, for the loader's error
messages. Nothing here is collective.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.commit import COMMIT_MARKER, read_document
from lightning_ft.checkpoint.coverage import coverage_problems
from lightning_ft.checkpoint.errors import CheckpointError
from lightning_ft.checkpoint.in_progress import discard, has_record, in_flight_paths
from lightning_ft.checkpoint.shard_reader import ShardReader
from lightning_ft.checkpoint.single_file import is_checkpoint_file, read_marker
from lightning_ft.checkpoint.snapshot_storage import fsync_dir
from lightning_ft.checkpoint.storage.object_store import ObjectStore, as_url, is_remote
from lightning_ft.checkpoint.storage.registry import storage_for_path
from lightning_ft.checkpoint.swap import parse_swap_name, recover_interrupted_swaps, swap_target

__all__ = [
    "COMMIT_MARKER",
    "CheckpointInfo",
    "cleanup_uncommitted",
    "is_committed",
    "latest_committed",
    "list_committed",
    "read_metadata",
    "read_state_index",
    "recover_interrupted_swaps",
    "repoint_last",
    "verify",
]

log = logging.getLogger(__name__)
_reported_lock = threading.Lock()
_reported_foreign: set[Path] = set()


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint found in a folder."""

    path: Path
    """The checkpoint directory."""
    step: int | None
    """Global step recorded in its metadata (``metadata["step"]``); ``None`` if the writer recorded none."""
    mtime: float
    """Modification time of its commit marker, Unix seconds; breaks ties between equal steps."""
    full_state: bool | None = None
    """Whether it holds the full training state (its marker's ``full_state``); ``None`` if the marker does not say
    (written by lightning-ft 0.1.0, or by a caller of :class:`AsyncCheckpointer` that passed no ``full_state``)."""


def is_committed(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory holding a commit marker (a link to one counts), or an object-store
    checkpoint whose marker object exists."""
    if is_remote(path):
        return ObjectStore().is_committed(path)
    return (Path(path) / COMMIT_MARKER).is_file() or is_checkpoint_file(path)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The run metadata of checkpoint ``path`` (``format_version``, ``step``, ``world_size``, and what the writer added).

    Works on uncommitted directories too (when their metadata file exists); raises :class:`CheckpointError` otherwise.
    """
    document = ObjectStore().read_document(path) if is_remote(path) else read_document(Path(path), require_commit=False)
    return json_codec.decode(document["metadata"])


def read_state_index(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, tuple[str, list[int]]]]:
    """The run metadata of checkpoint ``path`` (as :func:`read_metadata`) and what its document records of the model's
    state dict: ``{name: (dtype, global shape)}`` for every tensor under Lightning's ``state_dict`` key, by its name
    there (``"float32"``, ``[16, 8]``). Reads the document only, never the tensor data.

    Raises:
        CheckpointError: as :func:`read_metadata`.
    """
    document = ObjectStore().read_document(path) if is_remote(path) else read_document(Path(path), require_commit=False)
    prefix = "state_dict/"
    index: dict[str, tuple[str, list[int]]] = {}
    for key, record in document.get("tensors", {}).items():  # a folder's index: a record per tensor
        if key.startswith(prefix):
            index[key[len(prefix) :]] = (str(record.get("dtype")), list(record.get("global_shape", [])))
    for key, entry in document.get("checksums", {}).get("tensors", {}).items():  # a file's: [dtype, shape, crc32]
        if key.startswith(prefix):
            index[key[len(prefix) :]] = (str(entry[0]), list(entry[1]))
    return json_codec.decode(document["metadata"]), index


def list_committed(dirpath: str | os.PathLike) -> list[CheckpointInfo]:
    """Committed checkpoints directly under ``dirpath``, by step ascending (``None`` first, then marker time).

    Symlinks (such as ``last``), directories without a readable marker, and the staging and replaced folders of a
    replacement (``.<name>.lft-new-*``, ``.<name>.lft-old-*``: see :func:`recover_interrupted_swaps`) are skipped.
    Under an object-store URL, the marker objects are listed (``path`` is then a ``Path`` made from the URL, and
    ``mtime`` the commit time the marker records).
    """
    if is_remote(dirpath):
        return [
            CheckpointInfo(path=Path(c.path), step=c.step, mtime=c.time, full_state=c.full_state)
            for c in ObjectStore().list_committed(dirpath)
        ]
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    found = []
    for child in dirpath.iterdir():
        if child.is_symlink() or parse_swap_name(child.name):
            continue
        if child.is_file():
            marker = read_marker(child)  # a checkpoint file of ours (single-file format), committed where it stands
            if marker is not None:
                found.append(_file_info(child, marker))
            continue
        if not child.is_dir() or not is_committed(child):
            continue
        try:
            # The marker repeats the step and full_state, so listing a folder of large checkpoints reads small files.
            marker_file = child / COMMIT_MARKER
            marker = json.loads(marker_file.read_bytes())
            step, full_state = marker.get("step"), marker.get("full_state")
            mtime = marker_file.stat().st_mtime
        except (ValueError, UnicodeDecodeError, AttributeError, OSError):
            continue
        found.append(
            CheckpointInfo(
                path=child,
                step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                mtime=mtime,
                full_state=full_state if isinstance(full_state, bool) else None,
            )
        )
    return sorted(found, key=lambda c: (c.step is not None, c.step or 0, c.mtime, c.path.name))


def _file_info(path: Path, marker: dict[str, Any]) -> CheckpointInfo:
    step, full_state, time = marker.get("step"), marker.get("full_state"), marker.get("time")
    return CheckpointInfo(
        path=path,
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        mtime=float(time) if isinstance(time, (int, float)) else path.stat().st_mtime,
        full_state=full_state if isinstance(full_state, bool) else None,
    )


def latest_committed(dirpath: str | os.PathLike, *, exclude: Iterable[str | os.PathLike] = ()) -> CheckpointInfo | None:
    """The committed checkpoint with the highest step under ``dirpath``, skipping paths in ``exclude``; or ``None``."""
    excluded = {Path(p).resolve() for p in exclude}
    for info in reversed(list_committed(dirpath)):
        if info.path.resolve() not in excluded:
            return info
    return None


def newest_alternative(path: str | os.PathLike) -> str:
    """Message suffix naming the newest committed checkpoint next to ``path`` (other than it), for error messages."""
    path = Path(path)
    alternative = latest_committed(path.parent, exclude=[path])
    if alternative is None:
        # Said only when true: the refused checkpoint may itself be committed (intact, but not loadable here).
        other = " other" if is_committed(path) else ""
        return f"; no{other} committed checkpoint exists in {path.parent}"
    return f"; the newest committed checkpoint in {path.parent} is {alternative.path} (step {alternative.step})"


def verify(path: str | os.PathLike) -> list[str]:
    """Problems found in checkpoint ``path``: no marker, bad metadata, pickled entries, missing or corrupt shards,
    shards that do not cover every tensor of the index (see :mod:`~lightning_ft.checkpoint.coverage`).

    Reads every shard and checks its crc32 against the one recorded at save; returns ``[]`` when all is well. Not
    collective; any single process may call it.
    """
    path = Path(path)
    problems = []
    try:
        document = read_document(path, require_commit=False)
    except CheckpointError as e:
        return [str(e)]
    if document.get("file_format", 1) >= 2:  # Lightning's own file: its zip's CRC32s check every byte
        from lightning_ft.checkpoint.single_file import file_problems

        return file_problems(path)
    if not is_committed(path):
        problems.append(f"checkpoint {path} has no commit marker {COMMIT_MARKER}")
    problems += [f"checkpoint {path}: {problem}" for problem in coverage_problems(document)]
    try:
        reader = ShardReader(path, document, storage_for_path(path), verify_checksums=True)
    except CheckpointError as e:
        return [*problems, str(e)]
    for key, record in document["tensors"].items():
        for shard in record["shards"]:
            try:
                reader.read_shard(key, record, shard)
            except CheckpointError as e:
                problems.append(str(e))
    return problems


def _report_foreign(dirpath: Path, foreign: list[Path]) -> None:
    key = Path(os.path.abspath(dirpath))
    with _reported_lock:
        if key in _reported_foreign:
            return
        _reported_foreign.add(key)
    names = ", ".join(p.name for p in foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
    log.warning(
        "lightning-ft: %s holds %d folder(s) without a lightning-ft commit marker or in-progress record (%s): not"
        " written by lightning-ft as far as it can prove, so they are left alone. A checkpoint dirpath of its own keeps"
        " checkpoints apart from other files.",
        dirpath,
        len(foreign),
        names,
    )


def cleanup_uncommitted(
    dirpath: str | os.PathLike, *, keep: Iterable[str | os.PathLike] = (), older_than: float | None = None
) -> list[Path]:
    """Settle interrupted replacements (:func:`recover_interrupted_swaps`), then remove the saves of ours under
    ``dirpath`` that never finished: folders holding our in-progress record and no commit marker.

    ``older_than`` (a ``time.time()``; replica groups, where another process of the job may write into the same
    folder): only a folder in which nothing was modified at or after it is removed; a newer one may be a save another
    group has in flight, and is left alone (an object store's folders are then all left alone).

    Rank 0 only. Never touches a save in flight: those in ``keep`` (with their staging folders) and every save in
    flight in this process. Never touches what lightning-ft cannot prove it wrote: links, files, and folders without
    our record or marker (user files, a ``.git``, another tool's checkpoint, lightning-ft's event log) are left alone,
    and said so once per ``dirpath`` in the log (logger ``lightning_ft.checkpoint.discovery``, level WARNING).
    Returns the removed paths.
    """
    if is_remote(dirpath):
        if older_than is not None:
            return []
        kept_urls = [as_url(p) for p in (*keep, *in_flight_paths()) if is_remote(p)]
        return [Path(url) for url in ObjectStore().cleanup_uncommitted(dirpath, keep=kept_urls)]
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    kept = {Path(os.path.abspath(p)) for p in keep} | in_flight_paths()
    recover_interrupted_swaps(dirpath, keep=kept)
    removed, foreign = [], []
    for child in sorted(dirpath.iterdir()):
        if child.is_symlink() or not child.is_dir() or is_committed(child):
            continue
        if not has_record(child):
            foreign.append(child)
        elif Path(os.path.abspath(swap_target(child))) not in kept and (
            older_than is None or _last_modified(child) < older_than
        ):
            discard(child)
            removed.append(child)
    if foreign:
        _report_foreign(dirpath, foreign)
    return removed


def _last_modified(folder: Path) -> float:
    """The newest modification time of ``folder`` and of everything under it (``inf`` when it cannot be read: kept)."""
    try:
        newest = folder.stat().st_mtime
        for root, dirs, files in os.walk(folder):
            for name in (*dirs, *files):
                try:
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
                except FileNotFoundError:
                    continue
    except OSError:
        return float("inf")
    return newest


def repoint_last(dirpath: str | os.PathLike, target: str | os.PathLike, name: str = "last") -> Path:
    """Atomically point the link ``dirpath/name`` at ``target`` (a relative link); returns the link's path.

    A reader resolving the link at any moment sees either the old target or the new one, never a missing link.

    A checkpoint file of lightning-ft at ``dirpath/name`` (the ``last`` of a run that had one process until now) is
    replaced by the link the same way.

    Raises:
        FileExistsError: ``dirpath/name`` exists and is neither a link nor a checkpoint file of lightning-ft (a file or
            folder lightning-ft did not make); it is left as it is.
    """
    dirpath, target = Path(dirpath), Path(target)
    link = dirpath / name
    if link.exists() and not link.is_symlink() and not (link.is_file() and is_checkpoint_file(link)):
        raise FileExistsError(f"{link} exists and is not a link; lightning-ft does not replace it with one")
    # A relative target is taken relative to the current directory, like any path, unless only dirpath/target exists.
    if not target.is_absolute() and not target.exists():
        target = dirpath / target
    relative = os.path.relpath(os.path.abspath(target), os.path.abspath(dirpath))
    tmp = dirpath / f".{name}.tmp-{uuid.uuid4().hex}"
    os.symlink(relative, tmp, target_is_directory=True)
    os.replace(tmp, link)
    fsync_dir(dirpath)
    return link
