"""ThermalMonitor: reads each rank's own GPU through NVML and reports throttling per rank.

Every ``interval`` training batches each rank reads its device (temperature against the slowdown threshold, SM clock
against its maximum, power against the enforced limit, clock-event reasons, thermal and power violation time, ECC
counts) through the seam in :mod:`lightning_ft.nvml`. The readings are gathered to rank 0 in one small
``all_gather`` and logged as per-rank scalars; the rank that owns a device writes a ``thermal`` event when the device
enters or leaves throttling. With ``action="evict"``, a device held down by a thermal or hardware slowdown in
``evict_after`` readings in a row gets its node evicted (:func:`~lightning_ft.fault.eviction.evict_node`): every rank
counts from the same gathered rows, so all ranks decide together. Without NVML or without a GPU the monitor says so once and turns itself off. Steps an
earlier attempt of the run already reached are not logged again after a restart.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_ft.events import get_event_log, open_event_log
from lightning_ft.fault.internal import check_can_evict, evict_node
from lightning_ft.monitors._collectives import (
    PendingRows,
    acquire_group,
    any_rank,
    release_group,
    start_gather_rows,
)
from lightning_ft.monitors._replay import replayed_through
from lightning_ft.nvml import NVML, READING_FIELDS, NVMLLike, NVMLUnavailable, decode_reasons

log = logging.getLogger(__name__)

# Logged per rank under thermal/<name>/rank_<r>; violation times become seconds within the interval.
_LOGGED = (
    "temperature_c",
    "slowdown_temperature_c",
    "sm_clock_mhz",
    "max_sm_clock_mhz",
    "power_w",
    "power_limit_w",
    "thermal_violation_s",
    "power_violation_s",
    "ecc_corrected",
    "ecc_uncorrected",
    "throttled",
    "slowdown",
)
_SLOWDOWN = _LOGGED.index("slowdown")
SLOWDOWN_REASONS = ("SwThermalSlowdown", "HwSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown")
"""Clock-event reasons that count towards ``ThermalMonitor(action="evict")``: the device is held down by heat or by a
hardware signal. A power cap (``SwPowerCap``) or an application clock setting is normal under load and does not."""
ACTIONS = ("log", "evict")


class ThermalMonitor(Callback):
    """Per-rank temperature, clocks, power and throttle reasons, decoded by name, in TensorBoard and the event log.

    Collective: at ``setup`` (one ``all_reduce`` to agree whether any rank can read NVML) and every ``interval``
    training batches (one background ``all_gather`` of a few numbers, logged at the next reading and at the end of
    training); all ranks must carry the monitor.

    Args:
        interval: training batches between readings.
        devices: NVML index for each local rank (``devices[local_rank]``). Default: the local rank, mapped through
            ``CUDA_VISIBLE_DEVICES`` when that lists indices.
        nvml: the NVML to read (default: the real one); tests and CPU demos pass a
            :class:`~lightning_ft.nvml.FakeNVML`.
        log_per_rank: log ``thermal/<field>/rank_<r>`` for every rank; fleet maxima are always logged.
        action: ``"log"`` (default) or ``"evict"``: a rank whose device shows one of :data:`SLOWDOWN_REASONS` in
            ``evict_after`` readings in a row (repeated throttling, not a passing spike) gets its node evicted
            (``preempt-step=<N>`` saved, the node leaves through its torchrun agent with a health record, the
            others restart; docs/fault-tolerance.md). Needs torchrun with ``--max-restarts`` > 0, checked at setup.
        evict_after: consecutive throttled readings (``interval`` batches apart) that count as repeated, >= 1.

    Raises:
        ValueError: ``interval < 1``, an unknown ``action``, ``evict_after < 1``, or ``devices`` has no entry for a
            local rank (at setup); at setup, ``action="evict"`` outside torchrun or with ``--max-restarts=0``.

    Example::

        trainer = L.Trainer(callbacks=[ThermalMonitor(interval=50)])
    """

    uses_event_log = True
    """The run keeps its event log on disk from the start (:func:`lightning_ft.events.keeps_records`)."""

    def __init__(
        self,
        *,
        interval: int = 50,
        devices: Sequence[int] | None = None,
        nvml: NVMLLike | None = None,
        log_per_rank: bool = True,
        action: str = "log",
        evict_after: int = 3,
    ) -> None:
        if interval < 1:
            raise ValueError(f"ThermalMonitor(interval={interval!r}): must be >= 1")
        if action not in ACTIONS:
            raise ValueError(f"ThermalMonitor(action={action!r}): expected one of {ACTIONS}")
        if isinstance(evict_after, bool) or not isinstance(evict_after, int) or evict_after < 1:
            raise ValueError(f"ThermalMonitor(evict_after={evict_after!r}): must be an int >= 1 (readings in a row)")
        self.action = action
        self.evict_after = evict_after
        self.throttled_readings: list[int] = []
        """Per rank: readings in a row, up to the last gathered one, that showed a slowdown reason."""
        self.interval = interval
        self.devices = list(devices) if devices is not None else None
        self.nvml: NVMLLike = nvml if nvml is not None else NVML()
        self.log_per_rank = log_per_rank
        self.enabled = False
        self.device_index: int | None = None
        self.reasons: list[str] = []
        """Throttle reasons of this rank's device at the last reading."""
        self._readable = False
        self._batches = 0
        self._last_violation: dict[str, float] = {}
        self._pending: tuple[PendingRows, int] | None = None
        self._replayed_through = -1
        self._gathers_on_own_group = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.action == "evict":
            check_can_evict("ThermalMonitor(action='evict')", trainer)
        open_event_log(trainer)  # collective: every rank sets up
        local_rank = trainer.local_rank
        if self.devices is not None and local_rank >= len(self.devices):
            raise ValueError(
                f"ThermalMonitor(devices={self.devices!r}): no NVML index for local rank {local_rank}; give one per"
                " local rank"
            )
        self.device_index = self.devices[local_rank] if self.devices is not None else _default_index(local_rank)
        problem = ""
        try:
            self.nvml.init()
            count = self.nvml.device_count()
            if self.device_index >= count:
                raise NVMLUnavailable(f"NVML device {self.device_index} does not exist ({count} visible)")
            self.nvml.read(self.device_index)
            self._readable = True
        except NVMLUnavailable as err:
            problem = str(err)
            self._readable = False
        any_readable = any_rank(self._readable, trainer.strategy.root_device)
        self.enabled = any_readable
        if any_readable and not self._gathers_on_own_group:  # the same decision on every rank: collective
            acquire_group()
            self._gathers_on_own_group = True
        if not any_readable:
            rank_zero_warn(f"ThermalMonitor is off: no rank can read NVML ({problem}). Training continues without it.")
            self.nvml.shutdown()
        elif not self._readable:
            log.warning(
                "ThermalMonitor: rank %d cannot read NVML (%s); it reports nothing", trainer.global_rank, problem
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches = 0
        self._pending = None
        self.throttled_readings = []
        self._replayed_through = replayed_through(trainer) if trainer.is_global_zero else -1

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._log_rows(trainer, *pending, act=False)  # training is over: nothing to evict from

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.enabled:
            return
        self._batches += 1
        if self._batches % self.interval == 0:
            self._sample(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._gathers_on_own_group:
            self._gathers_on_own_group = False
            release_group()
        if self.enabled:
            self.nvml.shutdown()
            self.enabled = False

    def _read(self) -> dict[str, float | None]:
        if not self._readable or self.device_index is None:
            return dict.fromkeys(READING_FIELDS)
        try:
            return self.nvml.read(self.device_index)
        except NVMLUnavailable as err:
            log.warning("ThermalMonitor: reading NVML device %d failed (%s); skipped", self.device_index, err)
            return dict.fromkeys(READING_FIELDS)

    def _sample(self, trainer: pl.Trainer) -> None:
        reading = self._read()
        row = self._row(reading)
        reasons_bits = reading.get("reasons_bits")
        if reasons_bits is not None:
            reasons = decode_reasons(int(reasons_bits))
            if reasons != self.reasons:
                get_event_log(trainer).write(
                    "thermal",
                    device=self.device_index,
                    reasons=reasons,
                    throttled=bool(reasons),
                    temperature_c=reading.get("temperature_c"),
                    sm_clock_mhz=reading.get("sm_clock_mhz"),
                    max_sm_clock_mhz=reading.get("max_sm_clock_mhz"),
                    power_w=reading.get("power_w"),
                )
                level = logging.WARNING if reasons else logging.INFO
                log.log(
                    level,
                    "ThermalMonitor: rank %d device %s reasons %s",
                    trainer.global_rank,
                    self.device_index,
                    reasons,
                )
                self.reasons = reasons
        # Gathered in the background and logged at the next reading, so no rank stands still for the collective.
        previous, self._pending = (
            self._pending,
            (start_gather_rows(row, trainer.strategy.root_device), trainer.global_step),
        )
        if previous is not None:
            self._log_rows(trainer, *previous)

    def _log_rows(self, trainer: pl.Trainer, gathered: PendingRows, step: int, *, act: bool = True) -> None:
        rows = gathered.wait()
        # An earlier attempt of the run logged the steps up to `_replayed_through`.
        if trainer.is_global_zero and trainer.loggers and step > self._replayed_through:
            self._log(trainer, rows, step)
        self._count_slowdowns(trainer, rows, act=act)

    def _count_slowdowns(self, trainer: pl.Trainer, rows: list[list[float]], *, act: bool) -> None:
        # Every rank counts from the same gathered rows, so every rank reaches the same decision (evict is collective).
        counts = self.throttled_readings + [0] * (len(rows) - len(self.throttled_readings))
        self.throttled_readings = [c + 1 if r[_SLOWDOWN] == 1.0 else 0 for c, r in zip(counts, rows, strict=False)]
        if self.action != "evict" or not act:
            return
        repeated = [rank for rank, c in enumerate(self.throttled_readings) if c >= self.evict_after]
        if repeated:
            reason = (
                f"rank(s) {repeated}: GPU held down by a thermal or hardware slowdown in {self.evict_after} readings"
                f" in a row, {self.interval} batches apart"
            )
            evict_node(trainer, ranks=repeated, source="thermal", reason=reason)

    def _row(self, reading: dict[str, float | None]) -> list[float]:
        values: dict[str, float | None] = dict(reading)
        for kind in ("thermal", "power"):
            now = reading.get(f"{kind}_violation_ns")
            before = self._last_violation.get(kind)
            values[f"{kind}_violation_s"] = (now - before) / 1e9 if now is not None and before is not None else None
            if now is not None:
                self._last_violation[kind] = now
        bits = reading.get("reasons_bits")
        values["throttled"] = float(bool(decode_reasons(int(bits)))) if bits is not None else None
        slowdown = bits is not None and any(r in SLOWDOWN_REASONS for r in decode_reasons(int(bits)))
        values["slowdown"] = float(slowdown) if bits is not None else None
        return [math.nan if values.get(k) is None else float(values[k]) for k in _LOGGED]  # type: ignore[arg-type]

    def _log(self, trainer: pl.Trainer, rows: list[list[float]], step: int) -> None:
        metrics: dict[str, float] = {}
        for i, name in enumerate(_LOGGED):
            column = [r[i] for r in rows]
            if self.log_per_rank:
                metrics.update({f"thermal/{name}/rank_{rank}": v for rank, v in enumerate(column)})
            finite = [v for v in column if math.isfinite(v)]
            if finite and name in ("temperature_c", "power_w", "thermal_violation_s", "power_violation_s", "throttled"):
                metrics[f"thermal/{name}/max"] = max(finite)
        clocks = [r[2] / r[3] for r in rows if math.isfinite(r[2]) and math.isfinite(r[3]) and r[3] > 0]
        if clocks:
            metrics["thermal/sm_clock_ratio/min"] = min(clocks)
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _default_index(local_rank: int) -> int:
    # NVML numbers all GPUs of the machine; CUDA_VISIBLE_DEVICES renumbers the ones a process sees.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if local_rank < len(entries) and entries[local_rank].isdigit():
        return int(entries[local_rank])
    return local_rank
