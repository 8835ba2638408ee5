"""How a checkpoint file is committed: written beside its path, then renamed onto it; never a moment without one.

:class:`~lightning_ft.checkpoint.AsyncCheckpointer`, given a storage that writes files
(:class:`~lightning_ft.checkpoint.single_file.FileStorage`, ``checkpoint_format="file"``), runs these steps for a
save to a local path in its background thread, from the same staged copies a folder is written from (the capture at
the save call is the same; with more than one process every rank stages only the bytes of the replicated state it
writes, writes its share of the file in step 2, and rank 0 alone runs steps 1 and 3):

1. :func:`prepare_file` creates the save's staging folder ``.<name>.lft-new-<token>`` beside the path, holding the
   in-progress record (:mod:`~lightning_ft.checkpoint.in_progress`) before any data: a leftover of a killed save is
   proven ours and removed at the next start, exactly as a folder's.
2. The index (a crc32 per entry) and the metadata document are built and checked to cover every tensor; the file is
   written into the staging folder and fsynced with it.
3. :class:`FileSwap` renames it onto the path (fsync of the folder): ``os.replace`` onto a checkpoint file of ours is
   atomic, so a reader sees the old file or the new one. A committed folder at the path (a checkpoint of an earlier
   run on more processes) is moved aside first and deleted last; a committed file it replaces is kept as a hard link
   beside it until the commit callback succeeded, so a failed callback puts it back.

A file of ours at a checkpoint path is committed: nothing else ever puts one there. A kill at any instant leaves the
old checkpoint or the new one at the path; :func:`~lightning_ft.checkpoint.swap.recover_interrupted_swaps` removes
the staging folder and a replaced checkpoint left aside.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint.commit import COMMIT_MARKER
from lightning_ft.checkpoint.errors import CheckpointError
from lightning_ft.checkpoint.in_progress import discard, is_ours, is_placeholder, make_durable
from lightning_ft.checkpoint.sharded_file import holds_dtensors, rank_payload, write_sharded_file
from lightning_ft.checkpoint.single_file import STAGED_NAME
from lightning_ft.checkpoint.snapshot_storage import fsync_dir
from lightning_ft.checkpoint.swap import make_staging, swap_path

__all__ = ["FileSwap", "prepare_file", "write_parallel_file", "writes_files"]

log = logging.getLogger(__name__)

_said_differing = False  # the warning that the ranks' replicated state differs is said once per process


def writes_files(storage: Any) -> bool:
    """Whether the storage seam ``storage`` (or the storage it wraps or routes local paths to) writes one file per
    checkpoint."""
    seen = 0
    while storage is not None and seen < 16:
        if getattr(storage, "writes_files", False):
            return True
        storage = getattr(storage, "inner", None) or getattr(storage, "local", None)
        seen += 1
    return False


def prepare_file(path: Path, *, step: int | None, run_id: str | None) -> Path:
    """Create the staging folder a save of the checkpoint file ``path`` is written in, holding its in-progress record;
    return it. Rank 0 only.

    Raises:
        CheckpointError: ``path`` is a link, or a file or folder lightning-ft cannot prove it wrote; nothing is touched.
    """
    from lightning_ft.checkpoint.location import is_last_path

    if path.is_symlink() and not is_last_path(path):
        raise CheckpointError(f"cannot save to {path}: it is a link; lightning-ft does not write through links")
    # A `last` link (of a folder run, or Lightning's save_last="link") is replaced by the file, never written through.
    if not path.is_symlink() and path.exists() and not is_ours(path):
        raise CheckpointError(
            f"cannot save to {path}: it exists and lightning-ft cannot prove it wrote it (not a checkpoint file of"
            " ours, no commit marker, no in-progress record), so it is left alone; move it away or save to another path"
        )
    if not path.is_symlink() and path.is_dir() and not (path / COMMIT_MARKER).is_file():
        discard(path)  # an interrupted save of ours: one save is in flight at a time, so not this one's
    return make_staging(swap_path(path, "new", uuid.uuid4().hex[:16]), target=path, step=step, run_id=run_id)


class FileSwap:
    """Puts the checkpoint file written in the staging folder ``staged`` at ``target``. Rank 0 only.

    Example::

        swap = FileSwap(staged, target)
        swap.swap()  # target is the new file
        swap.finish()  # what it replaced and the staging folder are deleted
    """

    def __init__(self, staged: Path, target: Path) -> None:
        self.staged = staged
        self.target = target
        self.old = swap_path(target, "old", staged.name.rsplit("-", 1)[-1])
        self._old_kept = False
        self._new_moved = False

    def swap(self) -> None:
        """Rename the new file onto ``target``, durably; a committed checkpoint there is kept aside until
        :meth:`finish`."""
        new = self.staged / STAGED_NAME
        if self.target.is_symlink() or is_placeholder(self.target):
            pass  # a link or the placeholder holds no data: the rename below replaces it
        elif self.target.is_dir():
            os.rename(self.target, self.old)  # a committed folder of ours (prepare_file refused anything else)
            self._old_kept = True
            fsync_dir(self.target.parent)
        elif self.target.exists():
            os.link(self.target, self.old)  # a second name for the old file: no copy, and undo can put it back
            self._old_kept = True
        os.replace(new, self.target)
        self._new_moved = True
        fsync_dir(self.target.parent)

    def finish(self) -> None:
        """Delete the replaced checkpoint and the staging folder (a failure is a warning: the next cleanup does it)."""
        for leftover in (self.old, self.staged):
            try:
                discard(leftover)
            except Exception as e:  # noqa: BLE001 - a leftover of ours is removed by the next cleanup instead
                log.warning("lightning-ft: could not delete %s (%s); the next cleanup removes it", leftover, e)

    def undo(self) -> None:
        """Put the replaced checkpoint back at ``target`` and delete the new file, whichever steps had run."""
        if self._new_moved:
            os.rename(self.target, self.staged / STAGED_NAME)
            self._new_moved = False
            fsync_dir(self.target.parent)
        if self._old_kept:
            os.rename(self.old, self.target)
            self._old_kept = False
            fsync_dir(self.target.parent)
        discard(self.staged)


def write_parallel_file(
    job: Any,
    *,
    rank: int,
    agree: Callable[..., list[Any]],
    write: Callable[[Path, dict[str, Any], dict[str, Any]], None],
    document_of: Callable[[list[Any]], tuple[dict[str, Any], int]],
    on_commit: Callable[[int], Any],
) -> None:
    """The background steps of a save as one checkpoint file written by every rank of a data-parallel world.
    Collective: every rank of the writer's group runs it for the same save ``job`` (the writer's ``_Job``). A save of
    DTensor state writes the full tensors from every rank's own shards in steps 2 and 3
    (:func:`~lightning_ft.checkpoint.sharded_file.write_sharded_file`); steps 1 and the commit are the same.

    1. Rank 0 creates the staging folder with its in-progress record (:func:`prepare_file`), before any data.
    2. One exchange gives every rank every rank's own state (RNG states, per-rank tensors, callbacks' states; their
       staged bytes travel with it) so that every rank builds the same document and pickles the same object, and
       compares each rank's checksums of the replicated tensors with rank 0's. A rank that staged only its share of
       the file (the default: :attr:`~lightning_ft.checkpoint.staging.Capture.samples`) compares the crc32 of a sample
       of each tensor taken at the capture: the whole of a tensor of at most 16 KiB, 16 KiB of a larger one (its first
       and last 4 KiB and two chunks that move from save to save). Where they differ (a parameter DDP does not
       synchronize), rank 0's bytes of those tensors (rank 0 staged the whole of them at the save call:
       :func:`~lightning_ft.checkpoint.staging.stage_rank_zeros_copies`) go to every rank (a second exchange, said
       once): the file holds rank 0's copy, as ``DDPStrategy``'s checkpoint does. A difference only outside the sample
       is not detected, and the file then holds each rank's share of its own replica.
    3. ``write`` (the storage's, collective): every rank writes its share of the staged file; it returns once every
       rank's bytes are durable. Then rank 0 renames the file onto the path (:class:`FileSwap`) and calls
       ``on_commit`` with the tensor bytes; should either fail, the rename is undone. Every step ends with ``agree``,
       so a failure on any rank fails the save on every rank.
    """
    # 1. The staging folder.
    error: BaseException | None = None
    prepared = None
    if rank == 0:
        try:
            if job.prepare_error is not None:
                raise job.prepare_error
            if job.placeholder and is_placeholder(job.path):
                make_durable(job.path)  # off the training thread, before any data
            job.folder = prepare_file(job.path, step=job.metadata["step"], run_id=job.metadata["run_id"])
            prepared = str(job.folder)
        except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
            error = e
    folder = Path(agree(error, prepared)[0])
    if rank != 0:
        job.folder = folder
    if holds_dtensors(job.capture.tensors):  # DTensor state: the full tensors, from every rank's own shards
        size = write_sharded_file(job, folder / STAGED_NAME, rank=rank, agree=agree, document_of=document_of)
        _commit(job, folder, rank=rank, agree=agree, size_bytes=size, on_commit=on_commit)
        return

    # 2. Every rank's own state to every rank, with the crc32s of its copy of the replicated tensors.
    error, payload = None, None
    try:
        head, shared, entries = rank_payload(job, rank)
        payload = (
            *head,
            # What tells diverged replicas apart: where this rank staged only its share, the crc32 of a sample of each
            # replicated tensor taken at the capture (no rank read every byte); else the crc32 of its whole copy.
            job.capture.samples or {r["key"]: r["crc32"] for r in shared},
        )
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    gathered = agree(error, payload)
    error, differing = None, []
    try:
        reference = gathered[0][4]
        if any(set(theirs[4]) != set(reference) for theirs in gathered):
            raise CheckpointError(
                f"cannot save {job.path} as one file: the ranks' replicated state holds different tensors; a checkpoint"
                " file holds state every rank holds in full (data parallel)"
            )
        # Where a rank's copy differs from rank 0's (a parameter DDP does not synchronize: unfrozen after wrapping,
        # say), the file holds rank 0's, as DDPStrategy's checkpoint does: rank 0's bytes of those tensors go to
        # every rank below, so that no rank writes its own into the file.
        differing = sorted({k for theirs in gathered[1:] for k, crc in theirs[4].items() if reference[k] != crc})
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    agree(error)
    if differing:
        _take_rank_zeros_copy(job, rank, differing, entries, shared, agree)
    error = None
    try:
        for _, other_entries, _, _, _ in gathered:
            entries.update(other_entries)
        shared_index = {k: v for k, v in job.capture.tensors.items() if not k.startswith("rank_state/")}
        per_rank = [
            (their_records + (shared if r == 0 else []), {**tensors, **(shared_index if r == 0 else {})}, rank_json)
            for r, (their_records, _, tensors, rank_json, _) in enumerate(gathered)
        ]
        document, size_bytes = document_of(per_rank)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    agree(error)

    # 3. Every rank writes its share; rank 0 commits; the exchange tells every rank whether it did.
    error = None
    try:
        write(folder, entries, document)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    agree(error)
    _commit(job, folder, rank=rank, agree=agree, size_bytes=size_bytes, on_commit=on_commit)


def _commit(
    job: Any,
    folder: Path,
    *,
    rank: int,
    agree: Callable[..., list[Any]],
    size_bytes: int,
    on_commit: Callable[[int], Any],
) -> None:
    """Rank 0 renames the staged file onto the path and calls ``on_commit``; should either fail, the rename is undone.
    The exchange tells every rank whether it did."""
    error = None
    if rank == 0:
        swap = FileSwap(folder, job.path)
        try:
            swap.swap()
            job.committed = True
            on_commit(size_bytes)
        except BaseException as e:  # noqa: BLE001 - before the exchange, so every rank fails this save alike
            # A save reported as failed must not stay committed; a checkpoint it replaced comes back.
            try:
                swap.undo()
            except Exception as undo_error:  # noqa: BLE001 - the first error is the one raised
                log.warning("lightning-ft: undoing the failed save %s failed too (%s)", job.path, undo_error)
            job.committed = False
            error = e
        else:
            swap.finish()
    agree(error)


def _take_rank_zeros_copy(
    job: Any,
    rank: int,
    differing: list[str],
    entries: dict[str, Any],
    shared: list[dict[str, Any]],
    agree: Callable[..., list[Any]],
) -> None:
    """Collective: overwrite this rank's staged copies of the replicated tensors ``differing`` (keys, the same list
    on every rank) with rank 0's, and their crc32s in ``shared`` (this rank's index records), so that every rank
    writes rank 0's bytes into the file and pickles the same document. Warns once (rank 0)."""
    global _said_differing
    error, payload = None, None
    try:
        records = {r["entry"]: r for r in shared if r["key"] in set(differing)}
        if rank == 0:
            payload = {name: (entries[name].clone(), record["crc32"]) for name, record in records.items()}
            if not _said_differing:
                _said_differing = True
                more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
                log.warning(
                    "lightning-ft: the ranks' copies of %s%s differ (a parameter DDP does not synchronize, such as one"
                    " unfrozen after the model was wrapped); checkpoint %s holds rank 0's, as DDPStrategy's does, and"
                    " a resume gives every rank rank 0's",
                    ", ".join(differing[:3]),
                    more,
                    job.path,
                )
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    zeros = agree(error, payload)[0]
    error = None
    try:
        if rank != 0:
            for name, (data, crc) in zeros.items():
                entries[name].copy_(data)
                records[name]["crc32"] = crc  # this rank's index of the file is rank 0's too
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    agree(error)
