"""Checkpoint I/O of ``ElasticFT3D``: what a Lightning checkpoint dict becomes on disk, and back.

:class:`StrategyCheckpoints` is the strategy's one handle on the checkpoint package. It splits Lightning's checkpoint
dict into the state every rank shares, the state of each rank (callbacks, RNG, a pipeline stage) and the run's
metadata; hands it to the :class:`~lightning_ft.checkpoint.AsyncCheckpointer`; routes ``last*.ckpt`` saves and
``save_top_k`` removals to :class:`~lightning_ft.checkpoint.Retention`; and loads a checkpoint on every rank,
falling back to older committed ones when the newest is refused. Checkpoints of other strategies are imported by
:mod:`~lightning_ft.strategy.foreign_import`.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ft import _compat
from lightning_ft.checkpoint import AsyncCheckpointer, CheckpointError, load_checkpoint
from lightning_ft.checkpoint.internal import (
    CheckpointLocation,
    CommitInfo,
    ObjectStoreCheckpointer,
    Retention,
    RoutedStorage,
    as_url,
    discovery,
    existing_ancestor,
    is_last_path,
    is_remote,
    protocol_of,
    resolve_format,
    storage_named,
)
from lightning_ft.strategy.logger_calls import DeferredLoggerCalls

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.events import EventLog


def check_checkpoint_dirpath(dirpath: str) -> None:
    """Raise ``ValueError`` unless ``dirpath`` is a folder lightning-ft can keep checkpoints in: a local (or mounted)
    folder that is writable or can be created in an existing parent, or an object-store URL (``s3://``, ``gs://``,
    ``az://``, ``memory://``, ...) whose fsspec filesystem is installed and accepts a write. URLs of read-only or
    archive filesystems (``http://``, ``zip://``, ...) are refused."""
    protocol = protocol_of(str(dirpath))
    if protocol in (None, "file", "local"):
        _check_writable_dir(Path(fsspec.core.strip_protocol(str(dirpath)) if protocol else dirpath))
        return
    option = f"ModelCheckpoint(dirpath={str(dirpath)!r})"
    if protocol in _NOT_OBJECT_STORES:
        raise ValueError(
            f"{option}: {protocol}:// is not a storage ElasticFT3D can commit checkpoints to (read-only or an archive);"
            " use a local or shared folder, or an object store (s3://, gs://, az://)"
        )
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        raise ValueError(
            f"{option}: {protocol}:// needs a package that is not installed ({err}); install it (e.g. `pip install"
            " s3fs` for s3://, `gcsfs` for gs://, `adlfs` for az://) or use a local folder"
        ) from err
    except ValueError as err:
        raise ValueError(f"{option}: fsspec knows no filesystem for {protocol}:// ({err})") from err
    _check_writable_url(as_url(str(dirpath)), option)


def check_checkpoint_callback(callback: Any, *, world_size: int) -> None:
    """Raise ``ValueError`` for a ``ModelCheckpoint`` whose object-store ``dirpath`` cannot work with its options:
    ``save_last="link"`` (Lightning makes that link with ``os.symlink``; object stores have no links, and ``last`` is
    the newest committed marker anyway) and ``memory://`` with more than one process (each process has its own)."""
    dirpath = getattr(callback, "dirpath", None)
    if not dirpath or not is_remote(str(dirpath)):
        return
    option = f"ModelCheckpoint(dirpath={str(dirpath)!r}"
    if getattr(callback, "save_last", None) == "link":
        raise ValueError(
            f"{option}, save_last='link'): an object store has no links; use save_last=True (lightning-ft then writes"
            " no second copy: `last` is the newest committed checkpoint, found by listing)"
        )
    if protocol_of(str(dirpath)) == "memory" and world_size > 1:
        raise ValueError(
            f"{option}): memory:// is private to each process, so {world_size} processes cannot share checkpoints"
            " there; use an object store all ranks reach (s3://, gs://, az://) or a shared folder"
        )


_NOT_OBJECT_STORES = frozenset({"http", "https", "zip", "tar", "github", "git", "libarchive", "reference", "dir"})


def _check_writable_url(url: str, option: str) -> None:
    # A real PUT and DELETE of a probe object: credentials and bucket policies are what refuses writes here.
    try:
        fs, root = fsspec.core.url_to_fs(url)
        probe = f"{root.rstrip('/')}/.lightning-ft-probe-{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as err:  # noqa: BLE001 - every backend has its own errors; the message carries the reason
        raise ValueError(f"{option}: cannot write into {url} ({type(err).__name__}: {err})") from err


def _check_writable_dir(dirpath: Path) -> None:
    # Missing folders are created by the first save, as Lightning's own checkpoint I/O does: what must hold now is
    # that the nearest folder that exists takes new entries.
    target = existing_ancestor(dirpath)
    if target.exists() and not target.is_dir():
        raise ValueError(f"ModelCheckpoint(dirpath={str(dirpath)!r}): {str(target)!r} exists and is not a folder")
    try:
        # A real write, not os.access: permissions are not the only reason a folder refuses files (read-only mounts,
        # root on a filesystem that still says no).
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as err:
        raise ValueError(
            f"ModelCheckpoint(dirpath={str(dirpath)!r}): cannot write into {str(target)!r} ({err.strerror})"
        ) from err


def run_metadata(
    checkpoint: dict[str, Any],
    *,
    trainer: pl.Trainer | None,
    world_size: int,
    mesh: dict[str, int],
    parallelized: bool,
    optimizers: list[torch.optim.Optimizer],
    lr_scale: float,
    event_log: EventLog | None,
    lr_scale_state: dict[str, Any] | None = None,
    configured_accumulate_grad_batches: int | None = None,
    identity: dict[str, Any] | None = None,
    accumulate_grad_batches: int | None = None,
    replica_lr_scale_state: dict[str, Any] | None = None,
    replica_live_groups: int | None = None,
) -> dict[str, Any]:
    """The metadata of the run that writes ``checkpoint``: what a later resume (on any world) needs to decide.

    ``lr_scale`` is the elastic factor the saved optimizer rates carry; ``lr_scale_state`` the ramp it follows
    (:meth:`lightning_ft.elastic.LRScale.state_dict`); ``configured_accumulate_grad_batches`` the Trainer's own
    setting, before an elastic policy replaced it (``accumulate_grad_batches`` is the one in force); ``identity`` the
    model's (:func:`~lightning_ft.strategy.run_identity.module_identity`), which auto-resume compares with the live
    model's to tell this run's checkpoints from another experiment's. Replica groups: ``accumulate_grad_batches``
    (given) is the accumulation of the full membership, not the one the live groups' policy put in force, and
    ``replica_lr_scale_state`` / ``replica_live_groups`` (present only then) the live groups' learning-rate factor and
    the membership it was applied to (lightning_ft/elastic/replica_policy.py)."""
    return {
        "step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        # Lightning resumes training only from a full save; save_weights_only=True leaves out optimizers and loops.
        "full_state": "optimizer_states" in checkpoint and "loops" in checkpoint,
        "world_size": world_size,
        "mesh": mesh,
        "parallelized": parallelized,
        "per_device_batch_size": _per_device_batch_size(trainer),
        "accumulate_grad_batches": accumulate_grad_batches
        if accumulate_grad_batches is not None
        else (trainer.accumulate_grad_batches if trainer is not None else 1),
        "base_lrs": [[float(g.get("initial_lr", g["lr"])) for g in opt.param_groups] for opt in optimizers],
        "lr_scale": lr_scale,
        "lr_scale_state": lr_scale_state,
        "configured_accumulate_grad_batches": configured_accumulate_grad_batches,
        "run_id": event_log.run_id if event_log else None,
        "attempt": event_log.attempt if event_log else None,
        "run_identity": identity,
        **(
            {"replica_lr_scale_state": replica_lr_scale_state, "replica_live_groups": replica_live_groups}
            if replica_lr_scale_state is not None
            else {}
        ),
    }


def _per_device_batch_size(trainer: pl.Trainer | None) -> int | None:
    if trainer is None:
        return None
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    flat = getattr(loader, "flattened", None) or []
    for dl in flat:
        size = getattr(dl, "batch_size", None)
        if isinstance(size, int):
            return size
    return None


class StrategyCheckpoints:
    """Saves, removes and loads checkpoints for the strategy; one per strategy, opened at set-up.

    Args:
        global_rank: returns this process's rank (rank 0 commits, repoints ``last`` and deletes); read at each use,
            so the object can exist before the strategy knows its rank.
        event_log: returns the event log (``None`` before it is open).
        broadcast: rank 0's value on every rank (collective).
        all_ranks_agree: ``True`` on every rank when every rank passed ``True`` (collective).
        checkpoint_format: the storage new checkpoints are written with (``"torchsnapshot"``, ``"dcp"`` or ``"file"``).
    """

    def __init__(
        self,
        *,
        global_rank: Callable[[], int],
        event_log: Callable[[], EventLog | None],
        broadcast: Callable[[Any], Any],
        all_ranks_agree: Callable[[bool], bool] = lambda decision: decision,
        checkpoint_format: str = "torchsnapshot",
    ) -> None:
        self._rank = global_rank
        self._all_ranks_agree = all_ranks_agree
        self._format = checkpoint_format
        self._event_log = event_log
        self._broadcast = broadcast
        self._writer: AsyncCheckpointer | None = None
        self._lock = threading.Lock()
        self._unaccounted_stall_s = 0.0
        self._last_save: tuple[Path, int | None] | None = None
        self.retention = Retention(in_flight=self._in_flight, in_flight_step=self._in_flight_step)
        self._routed: RoutedStorage | None = None
        self._logger_calls = DeferredLoggerCalls(busy=self._busy, wait=self.wait)

    def _busy(self) -> bool:
        return self._writer is not None and self._writer.busy

    def defer_logger_calls(self, loggers: list[Any]) -> None:
        """Make ``loggers``' ``after_save_checkpoint`` wait for the commit of the save it announces
        (:mod:`~lightning_ft.strategy.logger_calls`); undone by :meth:`finish_logger_calls`."""
        self._logger_calls.install(loggers)

    def _settle_logger_calls(self, path: Path) -> None:
        """Before ``path`` changes: the kept logger calls that name it are made, after the save in flight commits; the
        wait is booked as a checkpoint stall."""
        start = time.perf_counter()
        self._logger_calls.settle(path)
        with self._lock:
            self._unaccounted_stall_s += time.perf_counter() - start

    def replay_logger_calls(self) -> None:
        """Make the loggers' calls that waited for a commit, if nothing is in flight now (training thread)."""
        self._logger_calls.replay()

    def finish_logger_calls(self) -> None:
        """Teardown, after :meth:`close`: the calls still kept are made, the loggers' methods put back."""
        try:
            self._logger_calls.replay()
        finally:
            self._logger_calls.drop()
            self._logger_calls.uninstall()

    def _in_flight(self) -> Path | None:
        return self._writer.in_flight if self._writer is not None else None

    def _in_flight_step(self) -> int | None:
        in_flight, last = self._in_flight(), self._last_save
        return last[1] if in_flight is not None and last is not None and last[0] == in_flight else None

    @property
    def writer(self) -> AsyncCheckpointer | None:
        """The background writer, while open (between set-up and teardown of ``fit``)."""
        return self._writer

    def open(self, *, storage: Any = None) -> None:
        """Start the background writer. Collective: it creates a process group of its own. ``storage``: the storage
        seam to write through (``None``: the format's storage, with object storage for URLs; a fault injector passes a
        wrapper, which keeps its faults around them)."""
        if self._writer is None:
            self._writer = ObjectStoreCheckpointer(on_commit=self._on_commit, storage=self._storage(storage))

    def _storage(self, wrapper: Any) -> Any:
        """The seam the writer uses: this format's storage for folders, object storage for URLs; inside ``wrapper`` (a
        fault injector's, whose innermost storage is replaced) when given."""
        name = self._format
        if name == "auto":
            # Not yet resolved at set-up (a save outside any stage: no mesh, no DTensor): plain state, the file.
            name = resolve_format(name, plain=True)
        storage = storage_named(name)
        routed = RoutedStorage(storage)
        self._routed = routed
        if wrapper is None:
            return routed
        holder = wrapper
        while hasattr(getattr(holder, "inner", None), "inner"):
            holder = holder.inner
        if hasattr(holder, "inner"):
            holder.inner = routed
        return wrapper

    def use_format(self, checkpoint_format: str) -> None:
        """Write new checkpoints with ``checkpoint_format`` from now on (the strategy's choice at set-up, once the
        world and the state are known; :func:`~lightning_ft.checkpoint.internal.resolve_format`)."""
        self._format = checkpoint_format
        storage = storage_named(checkpoint_format)
        if self._routed is not None:
            self._routed.local = storage

    def close(self) -> None:
        """Wait for the save in flight and stop the writer; re-raise a background failure. Every rank calls it."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def last_save_outcome(self) -> str:
        """What became of the newest save issued, in one clause for a message: committed or not, and the newest
        committed checkpoint beside it (what a restart resumes). For a teardown after another process died; reads the
        checkpoint folder, not collective."""
        if self._last_save is None:
            return "no checkpoint was being saved"
        path, step = self._last_save
        saved = f"{as_url(path)} (step {step})" if step is not None else as_url(path)
        newest = discovery.latest_committed(as_url(path.parent))
        if newest is not None and newest.path.name == path.name and newest.step == step:
            return f"the checkpoint in flight, {saved}, was committed before that; it is the last committed checkpoint"
        if newest is None:
            folder = as_url(path.parent)
            return f"the checkpoint in flight, {saved}, is not committed; no checkpoint is committed in {folder}"
        return (
            f"the checkpoint in flight, {saved}, is not committed; the last committed checkpoint is"
            f" {as_url(newest.path)} (step {newest.step})"
        )

    def save(
        self,
        path: Path,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        metadata: dict[str, Any],
        *,
        volatile_callbacks: frozenset[str] = frozenset(),
    ) -> None:
        """Collective: capture now, write and commit in the background (committed before returning outside fit).

        Every tensor is copied before this returns, so the checkpoint is the state at this call whatever the caller
        does next. From this call on, the path exists (a placeholder or the save's folder; the commit replaces it), so
        Lightning's version counter and every listing of the folder see the name taken, as under its own saves.

        A save Lightning routes to ``last*.ckpt`` is a checkpoint of its own at that path, as Lightning writes it.
        When the previous save is of the same step and every rank finds this state bitwise equal to what it captured
        (Lightning's ``ModelCheckpoint`` saves the top-k checkpoint, then ``last``, from one hook), it is written from
        that capture, after it, without a second copy of the state and without waiting for the save in flight.
        ``volatile_callbacks``: the state keys of the checkpoint callbacks, left out of that comparison (each records
        the path it is saving to, so their state differs between the two saves by design); the ``last`` file holds
        their state as of its own call.
        """
        self.replay_logger_calls()
        if is_last_path(path):
            step = metadata.get("step")
            same = self._same_as_previous(path, state, rank_state, step, volatile_callbacks)
            target = self.retention.plan_last(path, step, same_state=same) if self._rank() == 0 else None
            target = self._broadcast(str(target) if target is not None else None)
            if target is None:
                return
            path = Path(target)
            # A logger call kept for the save in flight may name this path (`last.ckpt` as the previous step left it):
            # it is made before this save can replace the file.
            self._settle_logger_calls(path)
            if self._rank() == 0 and not is_remote(path) and path.is_symlink():
                # The `last` link of an earlier lightning-ft or of save_last="link": it holds no data, and `last` is
                # now a checkpoint of its own, so the link makes way for it.
                path.unlink()
            if same is not None and not is_remote(path) and self._writer is not None:
                start = time.perf_counter()
                if self._writer.save_again(path, state, rank_state=rank_state, metadata=metadata):
                    with self._lock:
                        self._unaccounted_stall_s += time.perf_counter() - start
                    return
        self._last_save = (path, metadata.get("step"))
        if self._rank() == 0 and not is_remote(path):
            # As Lightning's TorchCheckpointIO does before it returns: a `save_last="link"` makes its link right after
            # this call, while the write (which would create the folder) is still in the background.
            path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        if self._writer is not None and self._logger_calls.pending:
            # This save waits for the one in flight anyway: the logger calls that waited for it are made first.
            self._writer.wait()
            self._logger_calls.replay()
        if self._writer is None:
            # No background writer outside fit: nothing would ever wait for it, so save and commit now.
            one_shot = ObjectStoreCheckpointer(on_commit=self._on_commit, storage=self._storage(None))
            try:
                one_shot.save(path, state, rank_state=rank_state, metadata=metadata)
            finally:
                one_shot.close()
            return
        self._writer.save(path, state, rank_state=rank_state, metadata=metadata)
        with self._lock:
            self._unaccounted_stall_s += time.perf_counter() - start

    def _same_as_previous(
        self,
        link: Path,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        step: int | None,
        volatile_callbacks: frozenset[str],
    ) -> Path | None:
        """The previous save, if it holds exactly this state on every rank (collective: every rank calls)."""
        previous = self._last_save
        same = None
        if (
            self._writer is not None
            and previous is not None
            and previous[1] == step
            and previous[0].parent == link.parent
        ):

            def normalize(rank_state_json: Any) -> Any:
                callbacks = rank_state_json.get("callbacks") if isinstance(rank_state_json, dict) else None
                if not isinstance(callbacks, dict):
                    return rank_state_json
                kept = {k: v for k, v in callbacks.items() if k not in volatile_callbacks}
                return {**rank_state_json, "callbacks": kept}

            found = self._writer.matches_last_save(state, rank_state=rank_state, normalize_rank_state=normalize)
            same = found if found == previous[0] else None
        return same if self._all_ranks_agree(same is not None) else None

    def add_stall_s(self, seconds: float) -> None:
        """Book ``seconds`` the loop was blocked by a save outside this object (the memory tier's capture), so the
        tracker counts it as a checkpoint stall like the durable tier's."""
        with self._lock:
            self._unaccounted_stall_s += seconds

    def take_unaccounted_stall_s(self) -> float:
        """Seconds save calls blocked the loop since the previous call (the tracker books them as stalls)."""
        with self._lock:
            stall, self._unaccounted_stall_s = self._unaccounted_stall_s, 0.0
        return stall

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.wait()

    def remove(self, path: Path) -> None:
        """Retention (``save_top_k``): a checkpoint in flight or the newest committed one is removed only after the
        next commit; what lightning-ft did not write is never removed."""
        if self._rank() == 0:
            self._settle_logger_calls(path)  # a logger call kept for the save in flight sees the file first
            self.retention.remove(path)

    def cleanup_leftovers(self, dirpaths: list[Path], *, older_than: float | None = None) -> list[Path]:
        """Rank 0, at train start: settle replacements a crash interrupted and remove the saves of ours that never
        committed under ``dirpaths``; never the save in flight, never a folder lightning-ft did not write, and with
        ``older_than`` never a folder modified since then (:func:`~lightning_ft.checkpoint.cleanup_uncommitted`).
        Returns the removed paths."""
        in_flight = self._in_flight()
        removed: list[Path] = []
        for dirpath in dirpaths:
            keep = [in_flight] if in_flight is not None else []
            removed += discovery.cleanup_uncommitted(dirpath, keep=keep, older_than=older_than)
        return removed

    def _on_commit(self, info: CommitInfo) -> None:
        """Runs on rank 0 in the checkpoint writer thread, once the commit marker is durable. An error here undoes the
        commit, so what can fail (the event line, repointing links) comes first and deletions last (they never
        raise)."""
        log = self._event_log()
        if log is not None:
            log.write(
                "checkpoint_committed",
                step=info.step,
                tier="durable",
                path=as_url(info.path),
                stall_s=info.stall_s,
                total_s=info.total_s,
                size_bytes=info.size_bytes,
            )
        self.retention.on_commit(info.path)

    def load(
        self,
        location: CheckpointLocation,
        *,
        fallbacks: list[CheckpointLocation],
        template: dict[str, Any] | None,
        rank_states: Callable[[dict[str, Any]], Any] | None = None,
        weights_only: bool | None = None,
    ) -> Any:
        """Load the committed lightning-ft checkpoint at ``location`` on every rank, or the first of ``fallbacks``
        (lightning-ft checkpoints too) that loads when it is refused.

        ``rank_states`` names other saved ranks whose rank state this rank needs, and ``weights_only`` is
        Lightning's argument (see :func:`~lightning_ft.checkpoint.load_checkpoint`).

        Collective. Returns the :class:`~lightning_ft.checkpoint.LoadedCheckpoint`. ``load_checkpoint`` makes every
        rank raise when any rank fails; the failing rank's own error (a read error, say) becomes a
        ``CheckpointError`` too, so that all ranks fall back together.

        Raises:
            CheckpointError: ``path`` and every fallback were refused (the error of the last one tried).
        """
        fallbacks = list(fallbacks)
        while True:
            path = location.path
            try:
                try:
                    return load_checkpoint(location, template, rank_states=rank_states, weights_only=weights_only)
                except CheckpointError:
                    raise
                except Exception as err:
                    raise CheckpointError(f"checkpoint {path}: {type(err).__name__}: {err}") from err
            except CheckpointError as err:
                if not fallbacks:
                    raise
                log = self._event_log()
                if self._rank() == 0 and log is not None:
                    log.write(
                        "checkpoint_rejected",
                        step=_saved_step(path),
                        tier="durable",
                        path=as_url(path),
                        reason=str(err),
                    )
                rank_zero_warn(f"Skipping checkpoint {path}: {err}. Falling back to {fallbacks[0].path}.")
                location = fallbacks.pop(0)


def _saved_step(path: Path) -> int | None:
    """The step a located (committed) checkpoint records, or ``None`` when even its metadata cannot be read."""
    try:
        return discovery.read_metadata(path).get("step")
    except CheckpointError:
        return None


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict as ``(state, rank_state)``: callback states and RNG states are per rank."""
    state = {k: v for k, v in checkpoint.items() if k != "callbacks"}
    rank_state: dict[str, Any] = {"rng": _compat.collect_rng_states()}
    if "callbacks" in checkpoint:  # a weights-only save has none, and its file has no such key
        rank_state["callbacks"] = checkpoint["callbacks"]
    return state, rank_state
