"""One model, always: the replica groups compare what must be equal, and agree on what a training step decided.

Each group trains on its own share of the global batch, but everything Lightning decides from a metric runs in every
group on its own: validation, ``EarlyStopping``, ``ReduceLROnPlateau``, ``ModelCheckpoint(monitor=...)``, a callback's
``trainer.should_stop``. Three rules keep the groups one model (docs/replica-groups-reference.md, "One model"):

- **Validation runs whole in every group.** The strategy splits only the training data over the groups
  (``ElasticFT3D.distributed_sampler_kwargs``); a validation, test or predict loader is split over the group's own
  processes, as under ``DDPStrategy`` with that many processes. The groups hold the same weights, so each computes the
  same metrics, bitwise, with nothing sent between groups: a group that dies mid-validation cannot stall the others.
- **The configuration is compared** (:mod:`~lightning_ft.replica.run_configuration`) at every new quorum (a group
  joins or leaves), before the state a joining group received is loaded and before its first forward pass: the
  processes per group, the per-device batch, ``accumulate_grad_batches``, precision, the model (class, parameter
  names, shapes and dtypes), the optimizers and their hyperparameters, the LR schedulers, gradient clipping, the
  elastic policy, the validation schedule and the run length. A group that differs from the live groups (those at
  the newest step; among equals, the most groups, then the lowest replica id) is refused with a ``ValueError`` naming
  the field and both values; the others discard the step and go on without it.
- **The decisions and the state are compared after every optimizer step.** After the batch's ``on_train_batch_end``
  hooks, before Lightning decides whether to validate, the groups exchange ``trainer.should_stop`` and a fingerprint
  of the state; again after the validation and plateau schedulers, at a step where they run in any group (each group
  says in the first exchange whether it validates at this step, stopping or not); and once more after the epoch-end
  hooks. The fingerprint holds the step, the learning rates, the LR schedulers' state, the accumulation in force, a checksum of the parameters
  (the bits of a rotating sample: up to :data:`PARAMETER_TENSORS` tensors a step, up to :data:`PARAMETER_WINDOW`
  elements of each, so a flipped bit in the sample shows) and a digest of the configuration. A stop any group
  decided is every group's, at the same step, before Lightning reads it (a stop raised between the exchanges at a
  step with no second one, which Lightning's loop does not do, is held for the next exchange: every group's one step
  later). A step without validation costs one exchange: nothing between the two points can change a decision or the
  state there. A group whose state differs from the
  others' is named (``replica_diverged``) and heals from a live group at the next step (its torchft step is set one
  back, so the quorum sends it the live state); one that differs again right after its heal, or when the fit ends
  before it could heal, stops with a ``RuntimeError``.

Every exchange is an all-gather through the torchft Manager's all-reduce (``ReplicaSync.exchange``), so a group that
dies or hangs during one costs the others at most ``ReplicaGroups.timeout``: the exchange then agrees on nothing, and
a stop waits (held, not applied) for the next exchange that succeeds.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_ft import _compat
from lightning_ft.replica.checkpoint_owner import checkpoint_writer
from lightning_ft.replica.run_configuration import (
    Difference,
    decode_configuration,
    digest,
    encode_configuration,
    first_difference,
    optimizer_settings,
    run_configuration,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "PARAMETER_TENSORS",
    "PARAMETER_WINDOW",
    "OneModel",
    "parameter_checksum",
    "reference_index",
    "state_fingerprint",
]

_log = logging.getLogger(__name__)

PARAMETER_WINDOW = 65536
"""Elements of a parameter tensor checksummed when it is compared: all of a tensor up to this size; of a larger one a
window that moves on by this much each time (:func:`parameter_checksum`)."""
PARAMETER_TENSORS = 32
"""Parameter tensors checksummed per comparison: all of a module that has no more; else each tensor every
``ceil(tensors / 32)`` steps. Every element of a tensor of ``n`` elements is compared every
``ceil(tensors / 32) * ceil(n / 65536)`` steps; the cost per step is bounded (32 sums of at most 65,536 elements)."""


# The fingerprint row: the exchange point, the committed step, the stop flag, whether this group's configuration is
# unchecked, then the compared values, then (first point) whether this group validates at this step, going on or
# stopping.
_POINT, _STEP, _STOP, _UNCHECKED, _CONFIG = 0, 1, 2, 3, 4
_STATE_FIELDS = (("accumulate_grad_batches", 5), ("learning rate", 6), ("learning rates", 7), ("lr_schedulers", 8))
_STATE_FIELDS += (("parameters", 9),)
_VALIDATES, _VALIDATES_STOPPING = 10, 11
_ROW = 12
_BEFORE_VALIDATION, _AFTER_BATCH, _AFTER_EPOCH = 1, 2, 3


def reference_index(keys: list[Any], members: list[str], candidates: list[int]) -> int:
    """Of ``candidates`` (indices into ``keys`` and ``members``), the one whose key is the reference: the key most
    candidates hold, and among keys held equally often, the one of the lowest replica id
    (:func:`~lightning_ft.replica.checkpoint_owner.checkpoint_writer`, the group that writes checkpoints)."""
    counts = Counter(keys[i] for i in candidates)
    most = max(counts.values())
    holders = [i for i in candidates if counts[keys[i]] == most]
    writer = checkpoint_writer([members[i] for i in holders])
    return next(i for i in holders if members[i] == writer)


# ---------------------------------------------------------------------------------------------------- state


def parameter_checksum(
    module: torch.nn.Module, step: int, *, window: int = PARAMETER_WINDOW, tensors: int = PARAMETER_TENSORS
) -> int:
    """A checksum of the parameters' bits (48 bits) that one comparison reads: of ``tensors`` of the module's
    parameter tensors (all of them when it has no more; else the ones whose index is ``step`` modulo the number of
    rounds it takes), a window of ``window`` elements (all of a smaller tensor; else from an offset that moves on by
    ``window`` every round, wrapping), its bits summed as 32-bit (16-bit, 8-bit for smaller dtypes) integers in int64
    on the tensor's device, one sum per tensor, one copy of the sums to the host. A changed bit changes the sum; the
    same bits give the same sum whatever the device's order of summation. A sharded parameter (a DTensor: FSDP2,
    tensor parallel) counts this rank's own shard: each rank compares with the same rank of the other groups."""
    params = [p for p in module.parameters() if p.numel() > 0]
    if not params:
        return 0
    rounds = math.ceil(len(params) / max(1, tensors))
    turn, lap = step % rounds, step // rounds
    sums = []
    for p in params[turn::rounds]:
        flat = (p.to_local() if isinstance(p, _compat.DTensor) else p).detach().reshape(-1)
        n = flat.numel()
        if n > window:
            start = (lap * window) % n
            end = start + window
            flat = flat[start:end] if end <= n else torch.cat([flat[start:], flat[: end - n]])
        flat = flat.contiguous()
        size = flat.element_size()
        words = flat.view(torch.int32 if size % 4 == 0 else torch.int16 if size % 2 == 0 else torch.uint8)
        sums.append(words.sum(dtype=torch.int64))  # < 2**31 a word, < 2**31 words: no overflow
    total = torch.stack(sums).cpu().tolist()
    return digest(struct.pack(f"<{len(total)}q", *total))


def _state_bytes(obj: Any, out: list[bytes]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(str(obj.dtype).encode())
        out.append(obj.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            out.append(str(key).encode())
            _state_bytes(obj[key], out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _state_bytes(value, out)
    elif isinstance(obj, float):
        out.append(struct.pack("<d", obj))
    else:
        out.append(repr(obj).encode())


def state_fingerprint(trainer: pl.Trainer, *, window: int = PARAMETER_WINDOW) -> list[float]:
    """The compared part of the fingerprint row: accumulation in force, the first learning rate (exact), all learning
    rates, the LR schedulers' state and the parameter checksum (digests of 48 bits, exact in float64)."""
    rates = [float(g["lr"]) for opt in trainer.optimizers for g in _compat.unwrap_optimizer(opt).param_groups]
    schedulers: list[bytes] = []
    for config in trainer.lr_scheduler_configs:
        _state_bytes(config.scheduler.state_dict(), schedulers)
    return [
        float(trainer.accumulate_grad_batches),
        rates[0] if rates else 0.0,
        float(digest(struct.pack(f"<{len(rates)}d", *rates))),
        float(digest(b"".join(schedulers))),
        float(parameter_checksum(trainer.lightning_module, trainer.global_step, window=window)),
    ]


# ---------------------------------------------------------------------------------------------------- the rules


class OneModel:
    """This process's part in keeping the replica groups one model during one fit (see the module docstring).

    Args:
        trainer: the fitting trainer.
        exchange: :meth:`~lightning_ft.replica.replica_sync.ReplicaSync.exchange` (every live group's row, or ``None``
            when a group failed during it).
        manager: the torchft ``Manager`` (a diverged group sets its step one back; a refusal discards the step).
        replica_id: this group's id; ``group_size`` its processes.
        write: writes an event (the caller writes on group rank 0 only).
        elastic: the strategy's ``ElasticPolicy`` (compared).

    Built at set-up on every rank of every group, after the optimizers (their hyperparameters are read then).
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        *,
        exchange: Callable[[list[float]], tuple[list[str], int, list[list[float]]] | None],
        manager: Any,
        replica_id: str,
        group_size: int,
        write: Callable[..., None],
        elastic: Any = None,
    ) -> None:
        self.check_trainer(trainer)
        self._trainer = trainer
        self._exchange = exchange
        self._manager = manager
        self._replica_id = replica_id
        self._group_size = group_size
        self._write = write
        self._elastic = elastic
        self._accumulate = int(trainer.accumulate_grad_batches)
        self._optimizers = optimizer_settings(trainer)
        self._configuration: dict[str, Any] | None = None
        self._configuration_digest: int | None = None
        self._checked_quorum: Any = None
        self._configuration_due = False  # a compare of the configurations was missed or disagreed: at the next quorum
        self._unchecked = False  # this group's last configuration exchange failed
        self._joined = False  # this process has had a quorum
        self._due: list[int] = []  # the exchange points still due in the running batch (an optimizer step ended in it)
        self._stop_agreed = False  # the stop the last exchange agreed on
        self._reported: set[tuple[int, str]] = set()  # (step, replica id) of the divergences named
        self._plateau_each_step = any(
            c.reduce_on_plateau and c.interval == "step" for c in trainer.lr_scheduler_configs
        )  # a plateau scheduler that steps in every batch's ``on_advance_end``: the second exchange at every step
        self._leaving = False
        self._held_stop = False  # a stop decided here that no exchange has carried yet
        self._stop_announced = False
        self._heal_due: tuple[int, list[str]] | None = None  # (step, fields) this group diverged at, not yet healed
        self._healed_divergence = False  # the last heal was for a divergence: one more and this group stops
        self.exchanges = 0
        self.configuration_checks = 0
        self.seconds = 0.0
        """Time spent in the comparisons and exchanges of this fit (the cost per step: ``seconds / exchanges``)."""
        self.fingerprint_seconds = 0.0
        self._patches = _compat.loop_decision_patches(
            trainer,
            before_validation=self._before_validation,
            after_batch=self._after_batch,
            after_epoch=self._after_epoch,
        )
        for patch in self._patches:
            patch.install()

    @staticmethod
    def check_trainer(trainer: pl.Trainer) -> None:
        """Refuse what would make the groups decide at different steps, before any work starts.

        Raises:
            ValueError: ``Trainer(val_check_interval=...)`` by wall time.
        """
        seconds = _compat.validation_by_wall_time(trainer)
        if seconds is not None:
            raise ValueError(
                f"ElasticFT3D(replica_groups=...) with Trainer(val_check_interval={trainer.val_check_interval!r}):"
                f" validation every {seconds:g} s of wall time would run at other steps in each replica group, and"
                " the groups would decide differently from it; give val_check_interval as a number of batches or a"
                " fraction of the epoch"
            )

    def configuration(self) -> dict[str, Any]:
        """This group's configuration (built when first asked, once the training loader exists)."""
        if self._configuration is None:
            self._configuration = run_configuration(
                self._trainer,
                group_size=self._group_size,
                accumulate=self._accumulate,
                optimizers=self._optimizers,
                elastic=self._elastic,
            )
        return self._configuration

    @property
    def configuration_digest(self) -> int:
        if self._configuration_digest is None:
            self._configuration_digest = digest(json.dumps(self.configuration(), sort_keys=True).encode())
        return self._configuration_digest

    # ------------------------------------------------------------------ at a quorum

    def after_quorum(
        self, *, quorum_id: Any, step: int, heal_source: str | None, source_configuration: dict[str, Any] | None
    ) -> bool:
        """Compare the configurations when the quorum is new (or a comparison was missed); returns whether the state
        a heal just received (from ``heal_source``) may be loaded.

        Every rank of every live group calls it at the first micro-batch of a step, after the quorum and before the
        received state is loaded (``step`` is this group's step before it). Collective across the groups when the
        quorum is new; whether it exchanges depends only on what every group shares (the quorum id, an earlier
        verdict).

        Raises:
            ValueError: this group's configuration differs from the live groups' (or, when the exchange failed, from
                the configuration of the group it heals from): the message names the field and both values.
        """
        self._joined = True
        if quorum_id == self._checked_quorum and not self._configuration_due:
            return True
        started = time.perf_counter()
        self._configuration_due = False
        mine = self.configuration()
        result = self._exchange([float(step), *encode_configuration(mine)])
        self.configuration_checks += 1
        self.seconds += time.perf_counter() - started
        if result is None:  # a group failed during it: the next fingerprint says this group is unchecked
            self._unchecked = True
            self._checked_quorum = None
            if source_configuration is not None:
                found = first_difference(mine, source_configuration)
                if found is not None:
                    self._refuse(found, reference=heal_source or "?", step=step)
            return True
        self._unchecked = False
        self._checked_quorum = quorum_id
        members, slot, rows = result
        configurations = [decode_configuration(row[1:]) for row in rows]
        keys = [json.dumps(c, sort_keys=True) for c in configurations]
        newest = max(row[0] for row in rows)
        candidates = [i for i, row in enumerate(rows) if row[0] == newest and configurations[i] is not None]
        if not candidates:
            return True
        ref = reference_index(keys, members, candidates)
        reference = configurations[ref]
        refused = [i for i in range(len(rows)) if keys[i] != keys[ref]]
        for i in refused:
            found = first_difference(configurations[i] or {}, reference) or Difference("configuration", None, None)
            if i == slot:
                self._refuse(found, reference=members[ref], step=step)
            _log.warning(
                "lightning-ft: replica group %r is refused: %s",
                members[i],
                found.describe(here="there", there=f"in replica group {members[ref]!r} (the live groups')"),
            )
            self._write(
                "replica_refused",
                step=step,
                replica_id=members[i],
                field=found.field,
                value=found.value,
                expected=found.expected,
                reference=members[ref],
            )
        if refused:  # this step is discarded at once: no all-reduce waits for a group that leaves
            self._manager.report_error(RuntimeError(f"replica group(s) {[members[i] for i in refused]} refused"))
        return heal_source is None or heal_source not in {members[i] for i in refused}

    def _refuse(self, found: Difference, *, reference: str, step: int) -> None:
        self._write(
            "replica_refused",
            step=step,
            replica_id=self._replica_id,
            field=found.field,
            value=found.value,
            expected=found.expected,
            reference=reference,
        )
        raise ValueError(
            f"ReplicaGroups: replica group {self._replica_id!r} is refused: "
            f"{found.describe(here='here', there=f'in replica group {reference!r}')} (the live groups'). Replica"
            " groups train one model: every group must run with the same processes per group, per-device batch,"
            " accumulate_grad_batches, precision, model, optimizers and their hyperparameters, LR schedulers,"
            " gradient clipping, elastic policy, validation schedule and run length. Start this group with the"
            " others' configuration."
        )

    def healed(self) -> None:
        """A heal's state is in place (on the training thread, at the start of a step)."""
        if self._heal_due is not None:
            self._heal_due = None
            self._healed_divergence = True

    # ------------------------------------------------------------------ after a step

    def voted(self) -> None:
        """An optimizer step ended (committed or discarded): the first exchange of this batch's end is due (it says
        whether the second is)."""
        self._due = [_BEFORE_VALIDATION]

    def _before_validation(self) -> None:
        if _BEFORE_VALIDATION in self._due:
            self._due.remove(_BEFORE_VALIDATION)
            self._compare(_BEFORE_VALIDATION)

    def _after_batch(self) -> None:
        if _AFTER_BATCH in self._due:
            self._due.remove(_AFTER_BATCH)
            self._compare(_AFTER_BATCH)
        elif self._trainer.should_stop and not self._stop_agreed:
            # Raised after the first exchange at a step with no second one: every group's at the next exchange.
            self._held_stop = True
            self._trainer.should_stop = False

    def leave(self) -> None:
        """This group leaves the fit between a step's vote and the end of its exchanges (an eviction, an error in a
        batch-end hook): take part in the exchanges still due, deciding nothing, so that the other groups do not
        wait ``timeout`` for it. Called at teardown, before the Manager shuts down; never raises."""
        self._leaving = True
        while self._due:
            point = self._due.pop(0)
            try:
                self._compare(point)
            except Exception as e:  # noqa: BLE001 - leaving anyway: the others see this group gone at the next quorum
                _log.info("lightning-ft: this replica group left without its exchange at point %d: %s", point, e)
                return

    def _after_epoch(self) -> None:
        if self._joined:  # not before this process's first quorum (every group has had one by an epoch's end)
            self._compare(_AFTER_EPOCH)

    def _compare(self, point: int) -> None:
        """One exchange point (collective across the groups: every group reaches the same points at the same step;
        whether a step has the second point is decided from the first point's rows, the same in every group)."""
        started = time.perf_counter()
        trainer = self._trainer
        local_stop = (bool(trainer.should_stop) or self._held_stop) and not self._leaving  # leaving is not stopping
        row = [float(point), float(trainer.global_step), float(local_stop), float(self._unchecked)]
        before = time.perf_counter()
        row.append(float(self.configuration_digest))
        row += state_fingerprint(trainer)
        self.fingerprint_seconds += time.perf_counter() - before
        if point == _BEFORE_VALIDATION and not self._leaving:  # a group that leaves validates nowhere
            row += [float(_compat.validation_due(trainer, stopping=s) is not False) for s in (False, True)]
        row += [0.0] * (_ROW - len(row))
        result = self._exchange(row)
        self.exchanges += 1
        try:
            if result is None:  # nothing agreed: a stop decided here waits for the next exchange
                self._held_stop = local_stop
                self._stop_agreed = False
                trainer.should_stop = False
                if point == _BEFORE_VALIDATION:  # no rows to decide from (this group's exchanges are off this step)
                    self._due.append(_AFTER_BATCH)
                return
            members, slot, rows = result
            if any(int(r[_POINT]) != point for r in rows):
                raise RuntimeError(
                    f"ReplicaGroups: the replica groups are out of step at step {trainer.global_step}: this group"
                    f" compared its state at point {point}, others at {[int(r[_POINT]) for r in rows]} (an epoch"
                    " that ended at another step in another group)"
                )
            self._agree_on_stop(members, rows)
            self._compare_state(members, slot, rows)
            if point == _BEFORE_VALIDATION:
                column = _VALIDATES_STOPPING if trainer.should_stop else _VALIDATES
                if self._plateau_each_step or any(r[column] for r in rows):
                    self._due.append(_AFTER_BATCH)
        finally:
            self.seconds += time.perf_counter() - started

    def _agree_on_stop(self, members: list[str], rows: list[list[float]]) -> None:
        trainer = self._trainer
        deciders = [members[i] for i, r in enumerate(rows) if r[_STOP]]
        self._held_stop = False
        if deciders and not self._stop_announced:
            self._stop_announced = True
            if not trainer.should_stop:
                _log.info("lightning-ft: replica group(s) %s stop the fit; this group stops with them", deciders)
            self._write("replica_stop", step=trainer.global_step, decided_by=deciders)
        trainer.should_stop = self._stop_agreed = bool(deciders)

    def _compare_state(self, members: list[str], slot: int, rows: list[list[float]]) -> None:
        step = self._trainer.global_step
        if any(r[_UNCHECKED] for r in rows) or len({r[_CONFIG] for r in rows}) > 1:
            self._configuration_due = True  # every group sees it: the configurations are compared at the next quorum
        newest = max(r[_STEP] for r in rows)
        candidates = [i for i, r in enumerate(rows) if r[_STEP] == newest]  # a group behind heals anyway
        keys = [tuple(r[i] for _, i in _STATE_FIELDS) for r in rows]
        ref = reference_index(keys, members, candidates)
        diverged = [i for i in candidates if keys[i] != keys[ref]]
        if slot not in diverged:
            self._healed_divergence = False
        for i in diverged:
            fields = [name for name, j in _STATE_FIELDS if rows[i][j] != rows[ref][j]]
            shown = ", ".join(_state_field(name, j, rows[i], rows[ref]) for name, j in _STATE_FIELDS if name in fields)
            if (step, members[i]) in self._reported:  # named at this step's earlier exchange
                continue
            self._reported.add((step, members[i]))
            if i != slot:
                _log.warning(
                    "lightning-ft: replica group %r differs from replica group %r at step %d in %s; it heals from a"
                    " live group at the next step",
                    members[i],
                    members[ref],
                    step,
                    shown,
                )
                self._write("replica_diverged", step=step, replica_id=members[i], fields=fields, reference=members[ref])
                continue
            if self._heal_due is not None:  # already set back (the epoch's end after its last step)
                continue
            self._write(
                "replica_diverged", step=step, replica_id=self._replica_id, fields=fields, reference=members[ref]
            )
            if self._healed_divergence:
                raise RuntimeError(
                    f"ReplicaGroups: replica group {self._replica_id!r} differs from replica group {members[ref]!r}"
                    f" again at step {step}, right after it healed from a live group, in {shown}: something in this"
                    " group changes its state outside the training step (a callback or hook editing weights or"
                    " learning rates on one group only?); stopping this group"
                )
            _log.warning(
                "lightning-ft: this replica group (%r) differs from replica group %r at step %d in %s; it heals from a"
                " live group at the next step",
                self._replica_id,
                members[ref],
                step,
                shown,
            )
            self._heal_due = (step, fields)
            # One step back: the next quorum sees this group behind the others and sends it their state.
            self._manager.load_state_dict(
                {"step": self._manager.current_step() - 1, "batches_committed": self._manager.batches_committed()}
            )

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        """Undo the loop patches; write what the comparisons cost.

        Raises:
            RuntimeError: this group diverged and the fit ended before it could heal.
        """
        for patch in self._patches:
            patch.undo()
        self._write(
            "replica_checks",
            step=self._trainer.global_step,
            exchanges=self.exchanges,
            configuration_checks=self.configuration_checks,
            seconds=self.seconds,
            fingerprint_seconds=self.fingerprint_seconds,
        )
        if self._heal_due is not None:
            step, fields = self._heal_due
            self._heal_due = None
            raise RuntimeError(
                f"ReplicaGroups: replica group {self._replica_id!r} differed from the live groups at step {step} in"
                f" {', '.join(fields)}, and the fit ended before it could heal from them: its final state is not the"
                " job's"
            )


def _state_field(name: str, index: int, value: list[float], expected: list[float]) -> str:
    if name in ("accumulate_grad_batches", "learning rate"):
        shown = int(value[index]) if name == "accumulate_grad_batches" else value[index]
        wanted = int(expected[index]) if name == "accumulate_grad_batches" else expected[index]
        return f"{name} ({shown!r} against {wanted!r})"
    return name
