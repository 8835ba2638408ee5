"""Asynchronous, consistent, sharded checkpoint saves with an atomic commit.

:class:`AsyncCheckpointer` is what the strategy calls at every checkpoint. ``save()`` blocks only while the state is
captured (the "stall"): it waits for the previous save, encodes the non-tensor state to JSON, decides which regions
this rank writes (:mod:`~lightning_ft.checkpoint.ownership`; one small exchange on the checkpoint group when the state
holds DTensors, none otherwise) and copies only those into staging buffers (:mod:`~lightning_ft.checkpoint.staging`),
all before ``save()`` returns, so that nothing the caller does afterwards reaches the checkpoint. A background thread
then runs the save in three collective steps, each ended by
:func:`~lightning_ft.checkpoint.agreement.agree` so that a failure on one rank fails the save on every rank:

1. rank 0 creates the folder the save writes into and, before any data, its in-progress record
   (:func:`~lightning_ft.checkpoint.swap.prepare`): the checkpoint path itself, or a staging folder beside it when the
   path holds a committed checkpoint, which is never touched before its replacement is committed. For a local path
   this runs in ``save()`` itself (a checkpoint file's name is held by a placeholder,
   :func:`~lightning_ft.checkpoint.in_progress.write_placeholder`), so that from the save call on the name exists, as
   it does under Lightning's synchronous save: ``ModelCheckpoint``'s version counter and every listing of the folder
   see it taken;
2. every rank writes its shards through torchsnapshot on a process group of its own and fsyncs them;
3. rank 0 commits: it checks that the shards cover every tensor of the index
   (:mod:`~lightning_ft.checkpoint.coverage`), writes the metadata file, then the commit marker, removes the
   in-progress record, swaps a staged checkpoint into place (:class:`~lightning_ft.checkpoint.swap.Swap`) and runs
   ``on_commit``. If anything after the marker fails (the swap, the callback), the save is undone: its marker is
   removed, the checkpoint it replaced is put back, and the save fails like any other. A save reported as failed is
   never committed.

A failed save's folder (or placeholder) is deleted by rank 0 (it holds our in-progress record). At most one capture
is in flight: :meth:`AsyncCheckpointer.save_again` writes that capture a second time, to another path (Lightning's
``save_last=True``: ``last`` is a checkpoint of its own, written as Lightning writes it, without a second capture). A failure
in the background is kept and raised once, at the next ``save()``, ``wait()`` or ``close()``; ``save()`` raises it
before starting anything, so a later save never runs while it is pending.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import torch.distributed as dist

from lightning_ft import _compat
from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.agreement import agree, is_distributed
from lightning_ft.checkpoint.commit import build_document, owned_records, write_marker, write_metadata
from lightning_ft.checkpoint.errors import CheckpointWriteError
from lightning_ft.checkpoint.file_commit import FileSwap, prepare_file, write_parallel_file, writes_files
from lightning_ft.checkpoint.in_progress import (
    discard,
    is_placeholder,
    make_durable,
    mark_in_flight,
    remove_record,
    unmark_in_flight,
    write_placeholder,
)
from lightning_ft.checkpoint.ownership import regions_to_write
from lightning_ft.checkpoint.single_file import STAGED_NAME, read_marker
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage
from lightning_ft.checkpoint.staging import Capture, Stager, encode_state, file_shares, holds_bitwise
from lightning_ft.checkpoint.storage.object_store import is_remote
from lightning_ft.checkpoint.swap import Swap, prepare
from lightning_ft.checkpoint.writer_threads import lower_thread_priority

__all__ = ["THREAD_NAME", "AsyncCheckpointer", "CommitInfo"]

THREAD_NAME = "lightning-ft-checkpoint-writer"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitInfo:
    """Facts about one committed save, passed to ``on_commit`` on rank 0."""

    path: Path
    """The committed checkpoint directory."""
    step: int | None
    """``metadata["step"]`` as given to ``save()``; ``None`` if absent."""
    stall_s: float
    """Seconds ``save()`` blocked the caller (waiting for the previous save included)."""
    total_s: float
    """Seconds from the ``save()`` call until the commit marker was durable."""
    size_bytes: int
    """Tensor bytes written by all ranks together."""


@dataclass
class _Job:
    path: Path
    capture: Capture
    metadata: dict[str, Any]
    started: float
    stall_s: float
    future: Future
    registered: Path | None = None
    """The path marked in flight in this process by ``save()``."""
    folder: Path | None = None
    """The folder the data goes to: ``path``, or a staging folder beside it."""
    committed: bool = False
    """Whether the marker exists and the save was not undone."""
    prepare_error: BaseException | None = None
    """Rank 0: why the preparation in ``save()`` failed (raised in the background, so every rank fails the save)."""
    placeholder: bool = False
    """Rank 0: whether ``save()`` put a placeholder at ``path`` (a checkpoint file's name held while it is written)."""


def _job_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """What a save job carries of the caller's ``metadata``: all of it encoded for the metadata document, and the
    step, ``full_state`` and ``run_id`` the commit marker and the in-progress record repeat (``None`` where absent or
    of the wrong type)."""
    user = dict(metadata or {})
    full_state, run_id = user.get("full_state"), user.get("run_id")
    return {
        "user": json_codec.encode(user, path="metadata"),
        "step": user.get("step"),
        "full_state": full_state if isinstance(full_state, bool) else None,
        "run_id": run_id if isinstance(run_id, str) else None,
    }


class AsyncCheckpointer:
    """Saves nested state asynchronously as a committed, sharded lightning-ft checkpoint.

    Args:
        group: process group for checkpoint collectives: those of the background thread, and the exchange ``save()``
            runs (while the background thread is idle) when the state holds DTensors. ``None`` with torch.distributed
            initialized creates a gloo group, so construction is then collective (every rank calls). Never pass the
            training group: its collectives would interleave with the training loop's.
        storage: the storage seam (tests pass a fake to inject I/O errors).
        on_commit: called on rank 0, in the background thread, once a checkpoint's marker is durable and it stands at
            its path. An exception in it undoes the save (the marker is removed, a checkpoint it replaced is put back)
            and fails it on every rank (raised at the next ``save()``/``wait()``/``close()``), so ``on_commit`` must
            do what cannot be undone (deleting other checkpoints) last, after everything that can fail.
        reuse_buffers: keep the staging buffers between saves (no allocation after the first save, but one copy of
            this rank's share of the state stays in host memory).
        timeout: collective timeout of the gloo group created when ``group`` is ``None`` (default: torch's default);
            a save stuck on a dead peer fails after it.
        writer_niceness: added to the background writer's nice value (Linux: per thread; its I/O threads inherit it;
            capped at 19, the lowest priority), so that where the machine is short of cores the write yields to
            training. ``0`` leaves it unchanged.

    Example::

        checkpointer = AsyncCheckpointer()
        checkpointer.save("checkpoints/step=100", {"model": model.state_dict()}, metadata={"step": 100})
        ...  # keep training: later changes to the model do not reach the checkpoint
        checkpointer.close()
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None = None,
        storage: SnapshotStorage | None = None,
        on_commit: Callable[[CommitInfo], None] | None = None,
        reuse_buffers: bool = True,
        timeout: timedelta | None = None,
        writer_niceness: int = 19,
    ) -> None:
        if writer_niceness < 0:
            raise ValueError(f"AsyncCheckpointer(writer_niceness={writer_niceness}): must be >= 0 (0: unchanged)")
        self._owns_group = group is None and is_distributed()
        if self._owns_group:
            group = dist.new_group(backend="gloo", timeout=timeout)
        self._group = group
        self._storage = storage or SnapshotStorage()
        self._on_commit = on_commit
        self._stager = Stager(reuse_buffers=reuse_buffers)
        self._reuse_buffers = reuse_buffers
        self._previous: tuple[Path, Capture] | None = None
        self._niceness = writer_niceness
        self._rank = dist.get_rank(group) if is_distributed() else 0
        self._world_size = dist.get_world_size(group) if is_distributed() else 1
        self._queue: SimpleQueue[_Job | None] = SimpleQueue()
        self._current: _Job | None = None
        self._jobs: list[_Job] = []  # queued or being written, oldest first
        self._pending_error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group checkpoint I/O runs on (``None`` without torch.distributed)."""
        return self._group

    @property
    def in_flight(self) -> Path | None:
        """Path of the save being written in the background, or ``None``."""
        for job in list(self._jobs):
            if not job.future.done():
                return job.path
        return None

    @property
    def busy(self) -> bool:
        """Whether a save is queued or being written (a non-blocking look)."""
        return any(not job.future.done() for job in list(self._jobs))

    def save(
        self,
        path: str | Path,
        state: dict[str, Any],
        *,
        rank_state: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Capture ``state`` now and write it to ``path`` in the background.

        Collective: every rank calls it with the same ``state`` structure: the same keys, and a DTensor where the
        other ranks have one (rank 0's ``path`` and ``metadata`` win). Waits for the previous save, then raises its
        background error if it failed (once, and nothing of this save is started). Returns once what this rank writes
        is copied; from then on the caller may mutate every tensor and container it passed. ``rank_state`` is this
        rank's own (no DTensor): every rank's is kept. ``metadata["step"]`` and a boolean ``metadata["full_state"]``
        are repeated in the commit marker; ``metadata["run_id"]`` goes into the in-progress record.

        A save to a path that holds a committed checkpoint writes beside it and replaces it only once committed. A
        path holding anything lightning-ft cannot prove it wrote (a file, a link, a foreign folder) fails the save in
        the background (``CheckpointError``) and is left as it is.

        Raises:
            RuntimeError: the checkpointer is closed.
            CheckpointError, OSError: a previous save failed in the background.
            TypeError: ``rank_state`` holds a DTensor, a DTensor placement cannot be checkpointed, or a tensor holds
                no plain bytes (quantized, nested, meta); the message names its key. Nothing of this save started.
            CheckpointWriteError: the state holds DTensors and finding their local regions failed on another rank (the
                failing rank raises its own error); nothing of this save is written.
        """
        if self._closed:
            raise RuntimeError("AsyncCheckpointer.save() called after close()")
        started = time.perf_counter()
        self.wait()
        job_metadata = _job_metadata(metadata)
        encoded = encode_state(state, rank_state, rank=self._rank)
        # The background thread is idle after wait(), so the exchange of DTensor regions may use the group here.
        writes = self._regions(encoded, Path(path))
        shares_file = self._shares_file(Path(path)) and not _holds_dtensor(encoded)  # DTensor: sharded_file
        shares = file_shares(encoded.shared, self._world_size) if shares_file else None
        capture = self._stager.capture(encoded, writes, shares=shares, rank=self._rank, group=self._group)
        job = _Job(
            path=Path(path),
            capture=capture,
            metadata=job_metadata,
            started=started,
            stall_s=time.perf_counter() - started,
            future=Future(),
            registered=Path(path),
        )
        # The staged copies stay in the Stager's buffers until the next capture: what matches_last_save compares.
        self._previous = (job.path, capture) if self._reuse_buffers else None
        self._enqueue(job)

    def save_again(
        self,
        path: str | Path,
        state: dict[str, Any],
        *,
        rank_state: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Write what the previous :meth:`save` captured once more, to ``path``, with ``rank_state``'s own non-tensor
        values and ``metadata``; without a capture and without waiting for the save in flight.

        Collective, like :meth:`save`. The caller must have proven (:meth:`matches_last_save`, agreed on every rank)
        that ``state`` and ``rank_state`` hold, bitwise, the tensors and the shared non-tensor state the previous save
        captured; only the rank state's non-tensor values (a callback's state, say) may differ. The second checkpoint
        is written after the first, from the same staged copies, and committed on its own. Returns ``False`` (and does
        nothing) when no capture is kept (``reuse_buffers=False``, no previous save): the caller saves instead. A
        pending background error is raised by the next :meth:`save`/:meth:`wait`, not here.
        """
        if self._closed:
            raise RuntimeError("AsyncCheckpointer.save_again() called after close()")
        previous = self._previous
        if previous is None or (previous[1].shares and not self._shares_file(Path(path))):
            return False  # a capture of this rank's share of a file serves another such file only
        started = time.perf_counter()
        job_metadata = _job_metadata(metadata)
        encoded = encode_state(state, rank_state, rank=self._rank)
        job = _Job(
            path=Path(path),
            capture=dataclasses.replace(previous[1], rank_state_json=encoded.rank_state_json),
            metadata=job_metadata,
            started=started,
            stall_s=time.perf_counter() - started,
            future=Future(),
            registered=Path(path),
        )
        self._enqueue(job)
        return True

    def _shares_file(self, path: Path) -> bool:
        """Whether a save to ``path`` is one checkpoint file that every rank writes its share of (each rank then stages
        only the bytes of the replicated state it writes)."""
        return self._world_size > 1 and writes_files(self._storage) and not is_remote(path)

    def _regions(self, encoded: Any, path: Path) -> list[Any]:
        """The regions of the shared state this rank stages: those it owns (a file of DTensor state too:
        :mod:`~lightning_ft.checkpoint.sharded_file`), or, for a checkpoint file of replicated state written by several
        processes, all of them (each rank pickles the whole state and writes its share of the file from its own copy)."""
        if self._shares_file(path) and not _holds_dtensor(encoded):
            return regions_to_write(encoded.shared, rank=0, world_size=1, group=None)
        return regions_to_write(encoded.shared, rank=self._rank, world_size=self._world_size, group=self._group)

    def _enqueue(self, job: _Job) -> None:
        mark_in_flight(job.path)
        if self._rank == 0 and not is_remote(job.path):
            self._prepare_early(job)
        self._jobs = [j for j in self._jobs if not j.future.done()] + [job]
        self._current = job
        self._queue.put(job)

    def _prepare_early(self, job: _Job) -> None:
        """Rank 0, in the save call: the name exists from now on (a checkpoint file's placeholder, or the folder the
        save writes into with its in-progress record). A failure is kept for the background, where every rank fails
        the save alike."""
        try:
            if writes_files(self._storage):
                job.placeholder = write_placeholder(
                    job.path, step=job.metadata["step"], run_id=job.metadata["run_id"], durable=False
                )
            else:
                job.folder = self._prepare(job, durable=False)
        except BaseException as e:  # noqa: BLE001 - raised in the background thread, on every rank
            job.prepare_error = e

    def matches_last_save(
        self,
        state: dict[str, Any],
        *,
        rank_state: dict[str, Any] | None = None,
        normalize_rank_state: Callable[[Any], Any] | None = None,
    ) -> Path | None:
        """The path of the previous :meth:`save` if what this rank would write of ``state`` and ``rank_state`` is,
        bitwise, what that save captured on this rank; otherwise ``None``.

        Local: no communication and no wait for the save in flight (its staged copies are only read). Every rank
        answers for its own regions, so the caller must agree across ranks before relying on it. ``None`` as well when
        there is nothing to compare with: no previous save, ``reuse_buffers=False``, a DTensor in the state (its regions
        need an exchange) or a CUDA tensor (its copy would cost what a save costs). ``normalize_rank_state`` is applied
        to both rank states' JSON before they are compared (to leave out what may differ by design).
        """
        previous = self._previous
        if previous is None:
            return None
        path, captured = previous
        encoded = encode_state(state, rank_state, rank=self._rank)
        tensors = [*encoded.shared, *encoded.per_rank]
        if any(isinstance(t, _compat.DTensor) or t.is_cuda for _, t in tensors):
            return None
        normalize = normalize_rank_state or (lambda j: j)
        if encoded.state_json != captured.state_json or normalize(encoded.rank_state_json) != normalize(
            captured.rank_state_json
        ):
            return None
        writes = self._regions(encoded, path)
        mine = [(region.key, value) for region, value in writes] + encoded.per_rank
        return path if holds_bitwise(captured, mine) else None

    def wait(self) -> None:
        """Block until the saves in flight (if any) are committed; raise a pending background error, once."""
        for job in list(self._jobs):
            try:
                job.future.result()
            except BaseException:  # noqa: BLE001 - recorded in _pending_error by the thread
                pass
        self._jobs = []
        self._current = None
        self._raise_pending()

    def close(self) -> None:
        """Wait for the in-flight save, stop the background thread, raise a pending error. Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                for job in list(self._jobs):
                    job.future.exception()
                self._jobs = []
                self._current = None
            finally:
                self._queue.put(None)
                self._thread.join()
                if self._owns_group and dist.is_initialized():
                    # A gloo group left to the interpreter's exit can abort the process ("terminate called without
                    # an active exception") after training succeeded; nothing uses it once the writer has stopped.
                    dist.destroy_process_group(self._group)
        self._raise_pending()

    def _raise_pending(self) -> None:
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    # -- background thread -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        lower_thread_priority(self._niceness)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except BaseException as e:  # noqa: BLE001 - kept and raised in the caller's thread
                if self._pending_error is None:  # never overwrite the first error
                    self._pending_error = e
                self._release(job)
                job.future.set_exception(e)
            else:
                self._release(job)
                job.future.set_result(None)

    def _release(self, job: _Job) -> None:
        job.capture = None  # type: ignore[assignment]  # the staging buffers stay with the Stager
        if job.registered is not None:
            unmark_in_flight(job.registered)
            job.registered = None

    def _agree(self, error: BaseException | None, payload: Any = None) -> list[Any]:
        return agree(error, payload, group=self._group, what="checkpoint save", error_type=CheckpointWriteError)

    def _write(self, job: _Job) -> None:
        try:
            self._write_steps(job)
        except BaseException:
            if self._rank == 0 and job.folder is not None and not job.committed:
                # Every rank is past the exchange that reported the failure, so nobody writes into it any more.
                self._discard_failed(job)
            if self._rank == 0 and job.placeholder and not job.committed and is_placeholder(job.path):
                _discard_quietly(job.path, "the placeholder of a failed save")
            raise

    def _prepare(self, job: _Job, *, durable: bool = True) -> Path:  # seam hooks with _discard_failed and _commit
        return prepare(job.path, step=job.metadata["step"], run_id=job.metadata["run_id"], durable=durable)

    def _discard_failed(self, job: _Job) -> None:
        _discard_quietly(job.folder, "the folder of a failed save")  # type: ignore[arg-type]

    def _write_steps(self, job: _Job) -> None:
        if writes_files(self._storage) and not is_remote(job.path):
            self._write_file(job)
            return
        # 1. Rank 0 creates the folder, with the in-progress record, before any byte of data; its path wins.
        error: BaseException | None = None
        prepared = None
        if self._rank == 0:
            try:
                if job.prepare_error is not None:
                    raise job.prepare_error
                if job.folder is None:  # an object-store URL: prepared here, off the training thread
                    job.folder = self._prepare(job)
                else:
                    make_durable(job.folder)  # prepared in save(): its record durable before any data
                prepared = (str(job.path), str(job.folder))
            except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
                error = e
        path, folder = self._agree(error, prepared)[0]
        job.path, job.folder = Path(path), Path(folder)

        # 2. Every rank writes its shards; the exchange shows every rank's data durable.
        records, error = [], None
        try:
            entries, records = job.capture.entries_and_records(self._rank)
            self._storage.write(job.folder, entries, group=self._group)
        except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
            error = e
        capture = job.capture
        payload = (
            records,
            capture.tensors if self._rank == 0 else owned_records(capture.tensors, records),
            capture.rank_state_json,
        )
        gathered = self._agree(error, payload)

        # 3. Rank 0 commits; the exchange tells every rank whether it did. Should that exchange itself fail (a peer
        # died after its data was durable), the checkpoint, complete by then, stays committed.
        error = None
        if self._rank == 0:
            try:
                self._commit(job, gathered)
            except BaseException as e:  # noqa: BLE001 - before the exchange, so every rank fails this save alike
                error = e
        self._agree(error)

    def _write_file(self, job: _Job) -> None:
        """A save as one checkpoint file (:mod:`~lightning_ft.checkpoint.file_commit`): in a world of one process no
        exchange; the steps are the folder's, with a rename onto the path as the commit."""
        if self._world_size != 1:  # every rank writes its share of the file (its own shards' of DTensor state)
            write_parallel_file(
                job,
                rank=self._rank,
                agree=self._agree,
                write=lambda folder, entries, doc: self._storage.write(
                    folder,
                    entries,
                    group=self._group,
                    document=doc,
                    **({"shares": job.capture.shares} if job.capture.shares else {}),
                ),
                document_of=lambda gathered: self._document(job, gathered, job.path),
                on_commit=lambda size: self._on_commit(self._commit_info(job, size)) if self._on_commit else None,
            )
            return
        if job.prepare_error is not None:
            raise job.prepare_error
        if job.placeholder and is_placeholder(job.path):
            make_durable(job.path)  # off the training thread, before any data
        job.folder = prepare_file(job.path, step=job.metadata["step"], run_id=job.metadata["run_id"])
        entries, records = job.capture.entries_and_records()
        gathered = [(records, job.capture.tensors, job.capture.rank_state_json)]
        document, size_bytes = self._document(job, gathered, job.path)
        self._storage.write(job.folder, entries, group=self._group, document=document)
        if read_marker(job.folder / STAGED_NAME) is None:
            # torch.save (or the CheckpointIO plugin) was replaced by something that wrote no checkpoint, as tests of
            # Lightning do to count calls: under DDPStrategy that save writes nothing and does not fail, so here it
            # commits nothing and does not fail; what stands at the path is left as it is.
            log.warning("lightning-ft: the save of %s wrote no checkpoint file; nothing is committed", job.path)
            _discard_quietly(job.folder, "the staging folder of a save that wrote nothing")
            if job.placeholder and is_placeholder(job.path):
                _discard_quietly(job.path, "the placeholder of a save that wrote nothing")
            return
        swap = FileSwap(job.folder, job.path)
        try:
            swap.swap()
            job.committed = True
            if self._on_commit is not None:
                self._on_commit(self._commit_info(job, size_bytes))
        except BaseException:
            # A save reported as failed must not stay committed; a checkpoint it replaced comes back.
            _undo_quietly(swap.undo, job)
            raise
        swap.finish()

    def _commit_info(self, job: _Job, size_bytes: int) -> CommitInfo:
        total_s = time.perf_counter() - job.started
        return CommitInfo(job.path, job.metadata["step"], job.stall_s, total_s, size_bytes)

    def _document(self, job: _Job, gathered: list[Any], name: Any) -> tuple[dict[str, Any], int]:
        """The save's metadata document and tensor bytes (refused when the shards do not cover the index)."""
        meta = job.metadata
        state_json = job.capture.state_json
        return build_document(
            meta["user"],
            step=meta["step"],
            world_size=self._world_size,
            state_json=state_json,
            gathered=gathered,
            name=name,
        )

    def _commit(self, job: _Job, gathered: list[Any]) -> None:
        assert job.folder is not None
        document, size_bytes = self._document(job, gathered, job.path)
        crc = write_metadata(job.folder, document)
        write_marker(job.folder, step=job.metadata["step"], metadata_crc32=crc, full_state=job.metadata["full_state"])
        job.committed = True
        swap = Swap(job.folder, job.path) if job.folder != job.path else None
        try:
            remove_record(job.folder)
            if swap is not None:
                swap.swap()
            if self._on_commit is not None:
                self._on_commit(self._commit_info(job, size_bytes))
        except BaseException:
            # A save reported as failed must not stay committed; a checkpoint it replaced comes back.
            _undo_quietly(swap.undo if swap is not None else lambda: discard(job.folder), job)
            raise
        if swap is not None:
            _discard_quietly(swap.old, "the checkpoint it replaced")


def _undo_quietly(undo: Callable[[], None], job: _Job) -> None:
    """Undo the commit of the failed save ``job`` (its error is the one raised: an error of the undo is logged)."""
    try:
        undo()
    except Exception as undo_error:  # noqa: BLE001 - the first error is the one raised
        log.warning(
            "lightning-ft: undoing the failed save %s failed too (%s); the next start settles it", job.path, undo_error
        )
    job.committed = False


def _discard_quietly(folder: Path, what: str) -> None:
    try:
        discard(folder)
    except Exception as e:  # noqa: BLE001 - a leftover of ours is removed by the next cleanup instead
        log.warning("lightning-ft: could not delete %s (%s): %s; the next cleanup removes it", what, folder, e)


def _holds_dtensor(encoded: Any) -> bool:
    return any(isinstance(t, _compat.DTensor) for _, t in encoded.shared)
