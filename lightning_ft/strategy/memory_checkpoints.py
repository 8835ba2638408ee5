"""The memory tier of ``ElasticFT3D`` (``memory_tier=MemoryTier(...)``): saves every few steps to node-local memory
and a partner node, and the choice at resume between it and the durable tier.

:class:`MemoryCheckpoints` is a callback the strategy puts on the Trainer when the tier is on. Its parts, in the order
a run meets them:

- ``open_tier`` (every rank, collective, from ``ElasticFT3D`` before the first load of a fit, which in data parallel
  comes before ``setup``): the node layout (``LOCAL_WORLD_SIZE`` and the rank numbering of torchrun: node-major), the
  partner (same local rank on node ``(node + 1) % num_nodes``), a gloo group of the tier's own.
- ``setup_tier`` (every rank, collective, from ``ElasticFT3D.setup`` once the optimizers exist: after ``plan`` and
  ``load`` in data parallel): the budget: the bytes a memory save needs per rank and per node against the free space
  of the folder and ``MemAvailable`` (a ``ValueError`` naming ``MemoryTier(...)`` on every rank when it does not fit).
- ``plan`` (every rank, collective, from auto-resume's choice): every rank checks the copies in its lane (CRC,
  coverage, step, run id, world layout), one ``all_gather_object`` of the small lists, and every rank computes the same
  newest step that every rank can restore from some holder; used when newer than the durable tier's newest.
- ``load`` (every rank, collective, from ``ElasticFT3D.load_checkpoint``): holders send the packed copies that other
  ranks need (point to point on the tier's group), every rank loads its own copy alone, and every rank learns whether
  all succeeded (on failure, the caller falls back to the durable tier).
- ``on_train_batch_end`` (every rank, at the same steps): every ``every_n_train_steps`` the checkpoint dict Lightning
  would save is captured (every tensor copied before the call returns) and handed to the background thread, which
  writes this rank's copy, swaps copies with the partner, and, once every rank reports its copy committed (one small
  all-reduce on the tier's group), deletes the older step. A failed write (a full ``/dev/shm``) fails that memory save
  only: a warning once, a ``checkpoint_failed`` event; every rank still runs the same exchanges.
- ``superseded`` (replica groups, every rank of a group that healed from a live group): removes the copies of the
  state the heal replaced. Each group keeps its own copies: the folder's name and every copy hold its replica id.
- ``close`` (teardown): waits for the save in flight; after a ``fit`` that returned normally, removes this rank's
  copies (the run's memory folder goes once empty).

The background thread runs collectives on the tier's group only, and every rank runs the same ones for every save, so
no collective is ever run by only some ranks; the training group is never used from it.

Why one module: the save, the plan and the restore share the node layout, the tier's process group and above all the
order of its collectives (sizes before bytes, the exchange before the commit all-reduce, the plan's gather before the
restore's transfers); that every rank runs the same sequence is checked by reading one file. The on-disk part (how a
copy is written, checked, packed) is :mod:`lightning_ft.checkpoint.memory_copies`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ft import _compat
from lightning_ft.checkpoint import CheckpointError, LoadedCheckpoint
from lightning_ft.checkpoint.internal import (
    MemoryTier,
    Stager,
    capture_own,
    check_copy,
    copy_folder,
    list_copies,
    load_copy,
    lower_thread_priority,
    pack,
    remove_others,
    run_folder,
    unpack,
    write_copy,
)
from lightning_ft.strategy.auto_resume import checkpoint_dirpaths
from lightning_ft.strategy.checkpoint_io import run_metadata, split_checkpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.strategy.elastic_ft3d import ElasticFT3D

__all__ = ["MemoryCheckpoints", "MemoryPlan", "MemoryRestoreError", "NodeLayout", "memory_budget"]

log = logging.getLogger(__name__)

THREAD_NAME = "lightning-ft-memory-tier"


@dataclass(frozen=True)
class NodeLayout:
    """Where this rank sits among the nodes, and who keeps its peer copy."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def partner(self) -> int:
        """The rank that keeps this rank's peer copy: same local rank, next node."""
        return ((self.node + 1) % self.num_nodes) * self.local_world_size + self.local_rank

    @property
    def source(self) -> int:
        """The rank whose peer copy this rank keeps: same local rank, previous node."""
        return ((self.node - 1) % self.num_nodes) * self.local_world_size + self.local_rank

    def describe(self) -> dict[str, int]:
        return {"num_nodes": self.num_nodes, "local_world_size": self.local_world_size}

    @classmethod
    def of(cls, strategy: ElasticFT3D) -> NodeLayout:
        """From torchrun's environment (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``), else the strategy's devices per node."""
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or strategy.num_processes or 1)
        local_rank = int(os.environ.get("LOCAL_RANK") or strategy.local_rank)
        return cls(strategy.global_rank, strategy.world_size, local_rank, local_world)


def memory_budget(state_bytes: int, *, layout: NodeLayout, peer_copy: bool) -> tuple[int, int]:
    """``(per_rank, per_node)`` bytes the memory tier's folder needs for a state of ``state_bytes`` per rank: the
    committed copy and the one being written, for this rank's own and (with a partner) for the peer copy it keeps."""
    copies = 2 + (2 if peer_copy and layout.num_nodes > 1 else 0)
    per_rank = copies * state_bytes
    return per_rank, per_rank * layout.local_world_size


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem holding ``path`` (the nearest existing parent). A seam tests replace."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def mem_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (``None`` where there is none). A seam tests replace."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _state_bytes(strategy: ElasticFT3D) -> int:
    """The bytes one rank's full state takes: parameters and buffers, and optimizer state (what exists, or for an
    optimizer that creates its state at its first step, two tensors like each parameter: Adam's moments)."""
    module = strategy.lightning_module
    total = 0
    if module is not None:
        total += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    for optimizer in strategy.optimizers:
        existing = sum(
            v.numel() * v.element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        params = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
        total += existing or 2 * params
    return total


@dataclass
class _Job:
    step: int
    capture: Any
    metadata: dict[str, Any]
    started: float
    stall_s: float
    done: threading.Event = field(default_factory=threading.Event)


class MemoryRestoreError(CheckpointError):
    """A planned memory restore failed on some rank; ``tier`` (``"local"``/``"peer"``) and ``path`` name the copy."""

    def __init__(self, message: str, *, tier: str, path: str) -> None:
        super().__init__(message)
        self.tier, self.path = tier, path


@dataclass(frozen=True)
class MemoryPlan:
    """The agreed memory restore: the step and, for every rank, who holds the copy it loads."""

    step: int
    sources: dict[int, tuple[int, bool, str]]
    """rank -> (holder rank, whether the holder keeps it as a peer copy, path on the holder)."""

    @property
    def restored_from(self) -> dict[str, int]:
        """Ranks per tier: ``local`` read a copy on their own node (their own, or one their node kept for the rank
        they now are), ``peer`` received theirs from another node."""
        local = sum(1 for r, (h, _, _) in self.sources.items() if h == r)
        return {"local": local, "peer": len(self.sources) - local, "durable": 0}


class MemoryCheckpoints(Callback):
    """The memory tier of one run (see the module docstring). Built by the strategy when ``memory_tier`` is given.

    Args:
        tier: the user's configuration.
        strategy: the strategy that owns the run (its rank, event log, mode, optimizers).
    """

    def __init__(self, tier: MemoryTier, strategy: ElasticFT3D) -> None:
        self.tier = tier
        self._strategy = strategy
        self._layout: NodeLayout | None = None
        self._group: Any = None
        self._run_dir: Path | None = None
        self._stager = Stager()
        self._queue: SimpleQueue[_Job | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._current: _Job | None = None
        self._warned = False
        self._plan: MemoryPlan | None = None
        self._last_step: int | None = None
        self._one_node_said = False
        self._preloaded: tuple[Path, LoadedCheckpoint] | None = None

    @property
    def state_key(self) -> str:
        return "lightning_ft._MemoryCheckpoints"

    @property
    def layout(self) -> NodeLayout:
        assert self._layout is not None, "MemoryCheckpoints.setup() first"
        return self._layout

    @property
    def run_dir(self) -> Path:
        assert self._run_dir is not None, "MemoryCheckpoints.setup() first"
        return self._run_dir

    @property
    def _peer_copy(self) -> bool:
        return self.tier.peer_copy and self.layout.num_nodes > 1

    # ------------------------------------------------------------------ set-up

    def open_tier(self, trainer: pl.Trainer | None) -> None:
        """Every rank, collective (creates the tier's gloo group once): the node layout, the run's folder (named by
        :func:`memory_run_name`: needs the configured model) and the group, which :meth:`plan` and :meth:`load` need.
        From ``ElasticFT3D`` before the first load of a ``fit`` (which comes before ``setup`` in data parallel), and
        from :meth:`setup_tier`."""
        strategy = self._strategy
        self._layout = NodeLayout.of(strategy)
        assert strategy.event_log is not None
        self._run_dir = run_folder(self.tier.resolved_dirpath(), memory_run_name(trainer, strategy))
        if dist.is_available() and dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")

    def setup_tier(self, trainer: pl.Trainer) -> None:
        """Every rank, collective (creates a gloo group, one exchange of budget problems). Starts the writer thread.

        Raises:
            ValueError: the parallel mode is not plain data parallel, or a save does not fit the folder or the
                node's memory (the numbers and the rule in the message); raised on every rank alike.
        """
        strategy = self._strategy
        self.open_tier(trainer)
        layout = self.layout
        problem = self._budget_problem(strategy)
        problems = self._all_gather(problem)
        first = next((p for p in problems if p), None)
        if first:
            raise ValueError(first)
        if layout.num_nodes == 1 and self.tier.peer_copy and not self._one_node_said:
            self._one_node_said = True
            rank_zero_info(
                "lightning-ft: MemoryTier(peer_copy=True) on one node keeps the local copy only: a peer copy needs a"
                " second node, so the state of a lost machine comes from the durable tier."
            )
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def _budget_problem(self, strategy: ElasticFT3D) -> str | None:
        option = f"ElasticFT3D(memory_tier=MemoryTier(dirpath={str(self.tier.resolved_dirpath())!r}, ...))"
        if strategy._mode.name != "data_parallel":
            return (
                f"{option}: the memory tier keeps plain data-parallel state; this run is {strategy._mode.name!r}"
                " (DTensor or pipeline parameters). Use the durable tier (ModelCheckpoint) alone."
            )
        try:  # a real write: permissions are not the only reason a folder refuses files
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.run_dir):
                pass
        except OSError as err:
            return f"{option}: cannot write into {str(self.run_dir)!r} ({err.strerror or err}); choose a writable node-local folder"
        state = _state_bytes(strategy)
        per_rank, per_node = memory_budget(state, layout=self.layout, peer_copy=self.tier.peer_copy)
        ram_node = per_node + state * self.layout.local_world_size  # plus each process's staging copy
        free = free_bytes(self.run_dir)
        available = mem_available_bytes()
        where = (
            f"a save of {state / 2**20:.1f} MiB per rank needs {per_rank / 2**20:.1f} MiB per rank and"
            f" {per_node / 2**20:.1f} MiB per node of {self.layout.local_world_size} ranks (its copy and the one being"
            f" written{', for itself and for the partner it keeps a copy of' if self._peer_copy else ''})"
        )
        if per_node > free:
            return (
                f"{option}: {where}, but the folder has {free / 2**20:.1f} MiB free (the rule: the per-node need must"
                " fit); make room, point MemoryTier(dirpath=...) or LIGHTNING_FT_MEMORY_DIR at a larger memory folder,"
                " or turn the tier off (memory_tier=None)"
            )
        if available is not None and ram_node > available:
            return (
                f"{option}: {where}, plus {state * self.layout.local_world_size / 2**20:.1f} MiB of staging copies, but"
                f" the node has {available / 2**20:.1f} MiB MemAvailable (the rule: it must fit in the node's"
                " available memory); free memory or turn the tier off (memory_tier=None)"
            )
        return None

    def _all_gather(self, obj: Any) -> list[Any]:
        if self._group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(out, obj, group=self._group)
        return out

    # ------------------------------------------------------------------ saving

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The resumed step is saved already: the micro-batches before the next optimizer step must not save it again.
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._thread is None or step == 0 or step % self.tier.every_n_train_steps or step == self._last_step:
            return
        self._last_step = step
        self.save(trainer, step)

    def save(self, trainer: pl.Trainer, step: int) -> None:
        """Every rank, at the same step: capture this rank's full state now; write and copy in the background."""
        started = time.perf_counter()
        self._wait_current()
        strategy = self._strategy
        checkpoint = _compat.checkpoint_connector(trainer).dump_checkpoint(weights_only=False)
        state, rank_state = split_checkpoint(checkpoint)
        metadata = run_metadata(
            checkpoint,
            trainer=trainer,
            world_size=strategy.world_size,
            mesh=strategy.mesh_shape(),
            parallelized=strategy._parallelized,
            optimizers=strategy.optimizers,
            event_log=strategy.event_log,
            identity=strategy.run_identity(),
            **strategy._elastic_resume.metadata(),
        )
        metadata.update(
            tier="memory",
            memory_rank=self.layout.rank,
            memory_world_size=self.layout.world_size,
            node_layout=self.layout.describe(),
            **self._replica(),
        )
        capture = capture_own(state, rank_state, self._stager)  # every tensor copied here
        job = _Job(step, capture, metadata, started, time.perf_counter() - started)
        self._current = job
        self._queue.put(job)
        if strategy._checkpoints is not None:  # the loop was blocked: a checkpoint stall in the goodput accounting
            strategy._checkpoints.add_stall_s(job.stall_s)

    def wait(self) -> None:
        """Block until the save in flight is done: every rank's copy committed (or the save failed). Every rank may
        call it; it runs no collective of its own."""
        self._wait_current()

    def _wait_current(self, timeout: float | None = None) -> None:
        job = self._current
        if job is not None:
            job.done.wait(timeout)
            if job.done.is_set():
                self._current = None

    def _run(self) -> None:
        # As the durable writer: where the machine is short of cores, the copy takes the cycles training leaves idle.
        lower_thread_priority(19)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except BaseException as e:  # noqa: BLE001 - the memory tier never fails the run
                self._failed(job.step, f"{type(e).__name__}: {e}")
            finally:
                job.done.set()

    def _write(self, job: _Job) -> None:
        layout, run_dir = self.layout, self.run_dir
        own = copy_folder(run_dir, rank=layout.rank, step=job.step, peer=False)
        size_bytes, error = 0, None
        try:
            size_bytes = write_copy(own, job.capture, job.metadata, step=job.step)
        except Exception as e:  # noqa: BLE001 - ENOSPC on /dev/shm and the like fail this save only
            error = f"{type(e).__name__}: {e}"
        peer_bytes, peer_folder = 0, None
        if self._peer_copy:
            payload = b""
            if error is None:
                try:
                    payload = pack(own)
                except OSError as e:
                    error = f"{type(e).__name__}: {e}"
            received = self._exchange(payload, send_to=layout.partner, receive_from=layout.source)
            peer_bytes = len(payload)
            if received:
                peer_folder = copy_folder(run_dir, rank=layout.source, step=job.step, peer=True)
                try:
                    unpack(received, peer_folder)
                except (OSError, CheckpointError) as e:
                    peer_folder = None
                    error = error or f"keeping rank {layout.source}'s peer copy: {type(e).__name__}: {e}"
        # Older steps go only once every rank committed this one: a rank killed mid-write still has the older step,
        # and so do all the others.
        if self._all_committed(error is None):
            keep = [own] + ([peer_folder] if peer_folder is not None else [])
            remove_others(run_dir, keep, local_rank=layout.local_rank, local_world_size=layout.local_world_size)
        if error is not None:
            self._failed(job.step, error)
            return
        event_log = self._strategy.event_log
        if layout.rank == 0 and event_log is not None:
            event_log.write(
                "checkpoint_committed",
                step=job.step,
                tier="memory",
                path=str(own),
                stall_s=job.stall_s,
                total_s=time.perf_counter() - job.started,
                size_bytes=size_bytes,
                peer_bytes=peer_bytes,
            )

    def _all_committed(self, ok: bool) -> bool:
        if self._group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _exchange(self, payload: bytes, *, send_to: int, receive_from: int) -> bytes:
        """Send ``payload`` to ``send_to`` and receive one from ``receive_from`` (sizes first; an empty payload: none).
        Every rank calls it with its own pair (point to point on the tier's group)."""
        group = self._group
        size_out = torch.tensor([len(payload)], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        for req in (dist.isend(size_out, send_to, group=group), dist.irecv(size_in, receive_from, group=group)):
            req.wait()
        reqs = []
        if payload:
            reqs.append(dist.isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), send_to, group=group))
        data_in = torch.empty(int(size_in.item()), dtype=torch.uint8)
        if data_in.numel():
            reqs.append(dist.irecv(data_in, receive_from, group=group))
        for req in reqs:
            req.wait()
        return data_in.numpy().tobytes() if data_in.numel() else b""

    def _failed(self, step: int, reason: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "lightning-ft: the memory-tier save of step %s failed on rank %s (%s); training goes on, the durable"
                " tier and the previous memory copy are unaffected (said once)",
                step,
                self.layout.rank,
                reason,
            )
        event_log = self._strategy.event_log
        if event_log is not None:
            event_log.write("checkpoint_failed", step=step, tier="memory", reason=reason)

    # ------------------------------------------------------------------ resume

    def _expected(self) -> dict[str, Any]:
        strategy = self._strategy
        assert strategy.event_log is not None
        return {
            "run_id": strategy.event_log.run_id,
            "mesh": strategy.mesh_shape(),
            "node_layout": self.layout.describe(),
            "memory_world_size": self.layout.world_size,
            **self._replica(),
        }

    def _replica(self) -> dict[str, str]:
        """Replica groups: ``{"replica_id": <this group's id>}``, recorded in every copy and checked at resume (a
        group restores only copies it wrote); empty without replica groups."""
        replica_id = replica_group_id(self._strategy)
        return {} if replica_id is None else {"replica_id": replica_id}

    def superseded(self, step: int) -> None:
        """Replica groups: this group's state was replaced by a live group's at ``step`` (a heal): the copies this
        rank's lane holds are of the state it had before, so they are removed (after the save in flight, which every
        rank of the group waits for alike: the group heals as one). A whole-job restart then never resumes the
        pre-heal state from this node; the next memory save holds the healed one. Every rank of the group calls it."""
        self._wait_current()
        if self._run_dir is None or self._layout is None:
            return
        layout = self._layout
        stale = [
            c.step
            for c in list_copies(self._run_dir, local_rank=layout.local_rank, local_world_size=layout.local_world_size)
        ]
        remove_others(self._run_dir, [], local_rank=layout.local_rank, local_world_size=layout.local_world_size)
        if stale:
            log.info("lightning-ft: memory copies of step(s) %s removed: this group healed at step %s", stale, step)

    def newest_own_step(self) -> int | None:
        """The step of this rank's newest own copy that passes its checks (marker, metadata, run, layout; the shards
        are not read): the newest step a memory restore could reach. Not collective (replica groups: rank 0 asks it
        before the live-group check of auto-resume)."""
        if self._run_dir is None or self._layout is None:
            return None
        layout, expected = self._layout, self._expected()
        for copy in list_copies(self._run_dir, local_rank=layout.local_rank, local_world_size=layout.local_world_size):
            if copy.rank == layout.rank and not copy.peer and check_copy(copy, expected, read_shards=False) is None:
                return copy.step
        return None

    def plan(self, durable_step: int | None) -> str | None:
        """Every rank, collective: the path (rank 0's source) to resume from when the memory tier has a step newer than
        ``durable_step`` that every rank can restore; else ``None`` (the durable tier is used)."""
        self._plan = None
        layout = self.layout
        expected = self._expected()
        held, rejected = [], []
        self._preloaded = None
        for copy in list_copies(self.run_dir, local_rank=layout.local_rank, local_world_size=layout.local_world_size):
            if self._preloaded is None and copy.rank == layout.rank and not copy.peer:
                # This rank's newest own copy is the likely restore: loading it is its check (every shard's crc32 as
                # it is read), so a local resume reads it once.
                reason = check_copy(copy, expected, read_shards=False)
                if reason is None:
                    try:
                        self._preloaded = (copy.path, load_copy(copy.path))
                    except CheckpointError as e:
                        reason = str(e)
            else:
                reason = check_copy(copy, expected)
            if reason is None:
                held.append((copy.rank, copy.step, copy.peer, str(copy.path)))
            else:
                rejected.append((copy.step, "peer" if copy.peer else "local", str(copy.path), reason))
        gathered = self._all_gather((held, rejected))
        event_log = self._strategy.event_log
        if layout.rank == 0:
            for _, rank_rejected in gathered:
                for step, tier, path, reason in rank_rejected:
                    rank_zero_warn(f"Skipping memory copy {path}: {reason}")
                    if event_log is not None:
                        event_log.write("checkpoint_rejected", step=step, tier=tier, path=path, reason=reason)
        plan = _agree_on_step(gathered, world_size=layout.world_size)
        if plan is None:
            self._preloaded = None
            return None
        if durable_step is not None and durable_step >= plan.step:
            rank_zero_info(
                f"lightning-ft: the durable checkpoint of step {durable_step} is as new as the memory tier's (step"
                f" {plan.step}); resuming from the durable tier"
            )
            self._preloaded = None
            return None
        self._plan = plan
        return plan.sources[0][2]

    def planned(self, path: Any) -> bool:
        """Whether ``path`` is the one :meth:`plan` chose (a load of it goes through :meth:`load`)."""
        return self._plan is not None and str(path) == self._plan.sources[0][2]

    def load(self, template: Any) -> tuple[LoadedCheckpoint, MemoryPlan]:
        """Every rank, collective: restore this rank's copy of the planned step (a holder on another node sends it).

        Raises:
            MemoryRestoreError: on every rank when any rank failed (the first failure's reason); the plan is dropped.
        """
        plan, self._plan = self._plan, None
        assert plan is not None
        layout = self.layout
        error: str | None = None
        loaded = None
        try:
            path = self._fetch(plan)
            preloaded, self._preloaded = self._preloaded, None
            if preloaded is not None and preloaded[0] == path and template is None:
                loaded = preloaded[1]
            else:
                loaded = load_copy(path, template)
        except Exception as e:  # noqa: BLE001 - every rank reaches the agreement below
            error = f"{type(e).__name__}: {e}"
        errors = self._all_gather(error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            rank, reason = failed[0]
            holder, _, path = plan.sources[rank]
            tier = "local" if holder == rank else "peer"
            raise MemoryRestoreError(
                f"memory copy {path} of rank {rank} (step {plan.step}, {tier} tier): {reason}", tier=tier, path=path
            )
        assert loaded is not None
        metadata = {**loaded.metadata, "world_size": layout.world_size}
        return LoadedCheckpoint(
            path=loaded.path,
            state=loaded.state,
            rank_state=loaded.rank_state,
            saved_rank=layout.rank,
            metadata=metadata,
        ), plan

    def _fetch(self, plan: MemoryPlan) -> Path:
        """This rank's copy on this node: its own or kept here, else received from its holder (and kept as its own
        copy). Every rank calls it; holders send to the ranks they hold a copy for."""
        me = self.layout.rank
        holder, _, path = plan.sources[me]
        sends = sorted((r, p) for r, (h, _, p) in plan.sources.items() if h == me and r != me)
        requests, keep = [], []
        sizes_out = {}
        for rank, source_path in sends:
            try:
                payload = pack(Path(source_path))
            except OSError:
                payload = b""
            sizes_out[rank] = payload
            size = torch.tensor([len(payload)], dtype=torch.int64)
            keep.append(size)
            requests.append(dist.isend(size, rank, group=self._group))
        size_in = torch.zeros(1, dtype=torch.int64)
        if holder != me:
            requests.append(dist.irecv(size_in, holder, group=self._group))
        for req in requests:
            req.wait()
        requests = []
        for rank, payload in sizes_out.items():
            if payload:
                tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                keep.append(tensor)
                requests.append(dist.isend(tensor, rank, group=self._group))
        data_in = torch.empty(int(size_in.item()), dtype=torch.uint8)
        if holder != me and data_in.numel():
            requests.append(dist.irecv(data_in, holder, group=self._group))
        for req in requests:
            req.wait()
        if holder == me:
            return Path(path)
        if not data_in.numel():
            raise CheckpointError(f"rank {holder}, which keeps this rank's copy {path}, could not send it")
        folder = copy_folder(self.run_dir, rank=me, step=plan.step, peer=False)
        unpack(data_in.numpy().tobytes(), folder)
        return folder

    # ------------------------------------------------------------------ teardown

    def close(self, *, finished: bool) -> None:
        """Wait for the save in flight (not forever after a failed run: a dead partner would hold the exchange) and
        stop the thread; after a ``fit`` that ``finished``, remove this rank's copies. Every rank calls it."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._wait_current(None if finished else 60.0)
            self._queue.put(None)
            thread.join(None if finished else 5.0)
        if finished and self._run_dir is not None and self._layout is not None:
            layout = self._layout
            remove_others(self._run_dir, [], local_rank=layout.local_rank, local_world_size=layout.local_world_size)
            for folder in (self._run_dir, self._run_dir.parent):
                try:
                    folder.rmdir()  # only when empty: the node's other ranks may still be removing theirs
                except OSError:
                    break
        group, self._group = self._group, None
        if group is not None and (thread is None or not thread.is_alive()) and dist.is_initialized():
            # As the durable writer does with its own: a gloo group left to the interpreter's exit can abort the
            # process after training succeeded, and it keeps the rendezvous store's port open in this process.
            dist.destroy_process_group(group)


def memory_run_name(trainer: pl.Trainer | None, strategy: ElasticFT3D) -> str:
    """The name of this run's memory folder: the run id, and a digest of the checkpoint folders (``ModelCheckpoint``
    dirpaths) and the model's identity. Another experiment started from the same working folder (same run id) with
    another checkpoint folder or another model has another memory folder: it never restores, nor removes, this run's
    copies."""
    assert strategy.event_log is not None
    # ModelCheckpoint made local dirpaths absolute.
    folders = sorted(str(p) for p in checkpoint_dirpaths(trainer)) if trainer is not None else []
    identity = {k: v for k, v in (strategy.run_identity() or {}).items() if k != "hparams"}  # as auto-resume compares
    fields: dict[str, Any] = {"dirpaths": folders, "identity": identity}
    replica_id = replica_group_id(strategy)
    if replica_id is not None:
        # Replica groups: each group keeps its own copies. Groups of one job share the run id (LIGHTNING_FT_RUN_ID)
        # and the checkpoint folder; two of them on one node (or one /dev/shm) would otherwise write the same
        # rank<r>/step=<N> folders and remove each other's.
        fields["replica_id"] = replica_id
    key = json.dumps(fields, sort_keys=True)
    return f"{strategy.event_log.run_id}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def replica_group_id(strategy: Any) -> str | None:
    """The replica group id of ``strategy``'s fit (``ElasticFT3D(replica_groups=...)``, resolved at set-up), else
    ``None``."""
    config = getattr(strategy, "_replica_config", None)
    return None if config is None else str(config.replica_id)


def _agree_on_step(gathered: list[tuple[list, list]], *, world_size: int) -> MemoryPlan | None:
    """The newest step for which every rank of ``range(world_size)`` has a valid copy on some holder, with the holder
    each loads from: its own copy where it has one, else the lowest holder rank. The same on every rank."""
    by_step: dict[int, dict[int, list[tuple[int, bool, str]]]] = {}
    for holder, (held, _) in enumerate(gathered):
        for rank, step, peer, path in held:
            by_step.setdefault(step, {}).setdefault(rank, []).append((holder, peer, path))
    for step in sorted(by_step, reverse=True):
        holders = by_step[step]
        if all(r in holders for r in range(world_size)):
            sources = {}
            for r in range(world_size):
                # Its own node first (its own copy before one kept there for it), else the lowest holder.
                options = sorted(holders[r], key=lambda o: (o[0] != r, o[1], o[0]))
                sources[r] = options[0]
            return MemoryPlan(step, sources)
    return None


def finished_fit(trainer: pl.Trainer | None) -> bool:
    """Whether ``trainer`` ran ``fit`` to its end (what lets the memory tier remove its copies)."""
    return (
        trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.FINISHED
    )
