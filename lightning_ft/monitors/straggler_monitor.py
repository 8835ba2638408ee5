"""StragglerMonitor: times every training step on every rank and names the rank that holds the others back.

In synchronous data parallel the gradient all-reduce equalises every rank's step time, so the whole-step wall time
cannot name a slow rank. Each rank therefore splits its own step into:

- data wait: from the end of its previous batch to the start of this one (the dataloader fetch, on the CPU clock);
- backward: ``on_before_backward`` to ``on_after_backward``. Under DDP the gradient all-reduce runs inside backward, so
  this is backward compute plus the time the rank waited there for the others;
- the rest of the step (forward, loss, optimizer step): compute with no collective in it.

A rank's *own time* is data wait plus the rest of the step: what it does before it can reach the collective. The slow
rank has the largest own time; the others show the difference as a longer backward. Every ``interval`` steps each rank
sends the medians and 90th percentiles of its window, plus the step at which its own times rose over its last two
windows (the onset it reports if it is named), in one ``all_gather`` of a few numbers, started in the background and
read at the end of the next window (so no rank waits for it); every rank then runs the same
:class:`~lightning_ft.monitors.straggler_detector.StragglerDetector` on the same numbers, so all ranks agree on an
action without another collective. A detection carries its diagnosis: which part of the named rank's step (data
wait or compute) exceeds the others' over the windows since its onset. Rank 0 logs and writes the events; it does not log the steps an earlier attempt
of the run already reached (they were logged then).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ft.events import get_event_log, open_event_log
from lightning_ft.fault.internal import check_can_evict, evict_node, replica_sync
from lightning_ft.monitors._collectives import PendingRows, acquire_group, release_group, start_gather_rows
from lightning_ft.monitors._replay import replayed_through
from lightning_ft.monitors._timing import StepClock, percentile, rise_step
from lightning_ft.monitors.fleet_statistics import PARTS, diagnose
from lightning_ft.monitors.straggler_detector import DetectorConfig, StragglerDetector, WindowResult, median
from lightning_ft.stop import EXIT_CODE_TEMPFAIL, checkpoint_and_stop

log = logging.getLogger(__name__)

STRAGGLER_EXIT_CODE = EXIT_CODE_TEMPFAIL
"""Exit code after ``action="checkpoint_and_stop"``: ``EX_TEMPFAIL`` (75), the same as after a preemption checkpoint;
non-zero so torchrun or the scheduler restarts."""

# Columns of the per-rank row gathered every interval: median and p90 of each field, then the step at which the rank's
# own time rose, then the number of steps measured, then the own time of each step of the window (NaN-padded to
# `interval`): every rank's k-th step of a window is the same global step, which the relative residual compares.
_FIELDS = ("own", "data", "compute", "backward", "step")
_RISE = len(_FIELDS) * 2
_COUNT = _RISE + 1
_STEPS = _RISE + 2

_PART_NAMES = {"data": "data wait", "compute": "compute (forward, loss, optimizer step)"}

MIN_GROUPS_COMPARED = 3
"""Replica groups: the fewest live groups whose step times :class:`StragglerMonitor` compares across groups (with
two, each is the other's only reference, and a noisy window would evict one of the two)."""

StragglerAction = Callable[["pl.Trainer", int, float], Any]


class StragglerMonitor(Callback):
    """Names ranks whose own step time (data wait plus compute, collective waits excluded) stays above the others.

    Works with any strategy and without a process group (one rank: it only logs its own times). Collective: every
    ``interval * windows_per_gather`` training batches all ranks join one small ``all_gather`` (on the monitors' own
    gloo group, in the background). With replica groups (``ElasticFT3D(replica_groups=...)``) every rank of every
    live group also joins, every ``interval`` committed steps, one exchange of its own time across the groups
    (torchft's all-reduce, inside the step): every group must run the monitor.

    Args:
        interval: training batches per window; one decision per window.
        windows_per_gather: windows whose rows go in one ``all_gather`` (1: one gather per window, as in 0.2.0).
            Each gather costs the ranks a thread hand-off; 2 halves that cost, and the first window of each pair is
            decided one window later.
        threshold: a rank slower than the median of the others by more than this fraction is slow in a window, or by
            more than the fleet's measured noise asks for (``noise_factor``), whichever is higher.
        patience: slow windows, among the last ``patience + 1``, before a rank is named.
        noise_factor: how many units of the fleet's own window-to-window noise a slow rank must exceed (see
            :class:`~lightning_ft.monitors.straggler_detector.DetectorConfig`); 0 keeps the fixed ``threshold``.
        cusum_limit: evidence, in noise units, that the sequential test must accumulate over windows to name a rank
            whose slowdown stays under the bar (``math.inf`` turns it off; see
            :class:`~lightning_ft.monitors.straggler_detector.DetectorConfig`).
        cusum_slack: least allowance per window of the sequential test, in noise units (0: half of a 15% excess,
            the allowance that names a 15% straggler soonest for a given rate of false alarms); higher keeps a
            healthy rank that runs a little behind from accumulating evidence, and cannot see an excess under twice
            the slack.
        warmup_steps: batches ignored at the start of every ``fit`` (compilation, allocator and cache warm-up).
        drift_threshold: slowdown against the rank's own baseline, net of the fleet's, that also names it
            (``math.inf`` turns drift detection off).
        min_excess_ms: absolute excess (milliseconds) a slow rank must also have.
        action: ``"log"`` (default), ``"checkpoint_and_stop"`` (every rank saves ``preempt-step=<N>`` in the
            ``ModelCheckpoint`` directory, waits for the commit, and exits with :data:`STRAGGLER_EXIT_CODE`),
            ``"evict"`` (the same save, then the named rank's node leaves the job through its torchrun agent with a
            health record that keeps it out for ``FaultPolicy.eviction_cooldown_s``, and the other nodes restart
            without it or with a waiting spare; needs torchrun with ``--max-restarts`` > 0, checked at setup; see
            docs/fault-tolerance.md; with replica groups the node's group leaves the quorum instead and nothing
            restarts, and groups slower than the others are named too: docs/replica-groups-reference.md, "Eviction"), or a
            callable ``action(trainer, suspect_rank, ratio)`` called on every rank
            with the same arguments.
        log_per_rank: log ``straggler/<field>_ms/rank_<r>`` for every rank (turn off for very large fleets; fleet
            min/median/max are always logged).
        clock: seconds, monotonic, read at each hook to time the steps (default: the host clock, and CUDA events on
            a GPU). Tests and replays of recorded timings pass a clock they drive.

    Raises:
        ValueError: for an unknown ``action`` or out-of-range numbers; at setup, for ``action="evict"`` outside
            torchrun or with ``--max-restarts=0``.

    Example::

        trainer = L.Trainer(callbacks=[StragglerMonitor(interval=8, action="checkpoint_and_stop")])
    """

    uses_event_log = True
    """The run keeps its event log on disk from the start (:func:`lightning_ft.events.keeps_records`)."""

    def __init__(
        self,
        *,
        interval: int = 8,
        windows_per_gather: int = 2,
        threshold: float = 0.12,
        patience: int = 3,
        warmup_steps: int = 10,
        drift_threshold: float = 0.2,
        min_excess_ms: float = 0.5,
        noise_factor: float = 3.0,
        cusum_limit: float = 12.0,
        cusum_slack: float = 0.0,
        action: str | StragglerAction = "log",
        log_per_rank: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if interval < 1:
            raise ValueError(f"StragglerMonitor(interval={interval!r}): must be >= 1")
        if windows_per_gather < 1:
            raise ValueError(f"StragglerMonitor(windows_per_gather={windows_per_gather!r}): must be >= 1")
        if warmup_steps < 0:
            raise ValueError(f"StragglerMonitor(warmup_steps={warmup_steps!r}): must be >= 0")
        if not callable(action) and action not in ("log", "checkpoint_and_stop", "evict"):
            raise ValueError(
                f"StragglerMonitor(action={action!r}): expected 'log', 'checkpoint_and_stop', 'evict' or a callable"
                " action(trainer, suspect_rank, ratio)"
            )
        self.interval = interval
        self.windows_per_gather = windows_per_gather
        self.warmup_steps = warmup_steps
        self.action = action
        self.log_per_rank = log_per_rank
        self.config = DetectorConfig(
            threshold=threshold,
            patience=patience,
            drift_threshold=drift_threshold,
            min_excess_ms=min_excess_ms,
            noise_factor=noise_factor,
            cusum_limit=cusum_limit,
            cusum_slack=cusum_slack,
        )
        self.clock = clock
        self.detector = StragglerDetector(self.config)
        self.detections: list[dict[str, Any]] = []
        """Every detection of this process so far (the fields of the ``straggler`` event)."""
        self.lost_s = 0.0
        """Seconds the fleet spent waiting for named ranks, from onset to recovery (open episodes included)."""
        self._recovered_lost_s = 0.0
        self._clock: StepClock | None = None
        self._batches = 0
        self._reduced = True  # whether the step that ended last reduced gradients (stepped the optimizer)
        self._window_start_step = 0
        self._pending: tuple[PendingRows, list[tuple[int, int]]] | None = None
        self._unsent: list[tuple[list[float], int, int]] = []
        self._previous_window: list[dict[str, float]] = []
        self._previous_median = -math.inf
        self._replayed_through = -1
        self._gathers_on_own_group = False
        self._windows: deque[tuple[int, dict[str, list[float]]]] = deque(maxlen=self.config.noise_windows)
        # Replica groups (docs/replica-groups-reference.md, "Eviction"): this rank's own times since the last exchange across
        # groups, the groups of the last exchange, their detector, and the ranks of this group to evict after the vote.
        self._group_own: list[float] = []
        self._group_members: list[str] = []
        self.group_detector = StragglerDetector(self.config)
        self._evict_group: tuple[list[int], str, float] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._clock = StepClock(trainer.strategy.root_device, self.clock)
        if stage == "fit" and self.action == "evict":
            check_can_evict("StragglerMonitor(action='evict')", trainer)
        if stage == "fit":
            open_event_log(trainer)  # collective: every rank sets up; detections are written from rank 0 only
            if not self._gathers_on_own_group:
                acquire_group()  # collective: the windows' gathers run beside the training step's collectives
                self._gathers_on_own_group = True

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._gathers_on_own_group:
            self._gathers_on_own_group = False
            release_group()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches = 0
        self._window_start_step = trainer.global_step
        self._pending = None
        self._unsent = []
        self._previous_window, self._previous_median = [], -math.inf
        self._windows.clear()
        self.detector = StragglerDetector(self.config)
        self._recovered_lost_s = 0.0
        self._replayed_through = replayed_through(trainer) if trainer.is_global_zero else -1
        self._group_own, self._group_members, self._evict_group = [], [], None
        self.group_detector = StragglerDetector(self.config)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The first batch of an epoch waits for dataloader workers to start: not a data wait of the steady state.
        self._clock_or_new(trainer).forget_previous_end()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation loop inside fit sits between two training batches: not a data wait.
        self._clock_or_new(trainer).forget_previous_end()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Lightning synchronises the ranks before it fetches each batch (its SIGTERM broadcast). After a step that
        # reduced gradients they are already in step and that costs nothing; after a micro-batch that only
        # accumulated, the ranks that finished first wait there for the slowest, and that wait would count as
        # their data wait and hide the slow rank.
        data_is_own = self._reduced or getattr(trainer, "accumulate_grad_batches", 1) == 1
        self._clock_or_new(trainer).step_start(trainer.global_step, data_is_own=data_is_own)
        self._reduced = False

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._reduced = True
        step = trainer.global_step
        replica = replica_sync(trainer)
        if replica is not None and step > 0 and step % self.interval == 0:
            # Inside the step, after the quorum and before the vote: every live group is at this committed step.
            self._compare_groups(trainer, replica, step)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._clock is not None:
            self._clock.backward_start()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is not None:
            self._clock.backward_end()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clock = self._clock_or_new(trainer)
        self._batches += 1
        clock.step_end(keep=self._batches > self.warmup_steps)
        if self._evict_group is not None:  # after the vote: the step is committed or discarded on every group alike
            ranks, reason, ratio = self._evict_group
            self._evict_group = None
            evict_node(trainer, ranks=ranks, source="straggler", reason=reason, extra={"ratio": ratio, "part": "group"})
        if self._batches % self.interval == 0:
            self._end_window(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._decide_gathered(trainer, *pending)
        # Windows not sent yet (a run that ends inside a gather's windows) are not judged: gathering them here would
        # add a blocking collective to the end of training.
        self._unsent = []
        for rank, lost_s in self.detector.open_episodes().items():
            if trainer.is_global_zero:
                get_event_log(trainer).write("straggler_cleared", suspect_rank=rank, lost_s=lost_s, recovered=False)

    def _clock_or_new(self, trainer: pl.Trainer) -> StepClock:
        if self._clock is None:
            self._clock = StepClock(trainer.strategy.root_device, self.clock)
        return self._clock

    def _end_window(self, trainer: pl.Trainer) -> None:
        assert self._clock is not None
        samples = self._clock.drain()
        row = [math.nan] * (_STEPS + self.interval)
        for i, name in enumerate(_FIELDS):
            values = [s[name] for s in samples]
            row[2 * i] = median(values)
            row[2 * i + 1] = percentile(values, 90)
        # Where this rank's own time rose, over this window and the one before: if this is the first slow window of
        # a streak, the slowdown may have begun in the tail of the previous one. A window whose median did not rise
        # above the previous one cannot be the first slow window after a healthy one: no need to look.
        if row[0] > self._previous_median:
            recent = self._previous_window + samples
            row[_RISE] = rise_step([int(s["at"]) for s in recent], [s["own"] for s in recent])
        self._previous_window, self._previous_median = samples, row[0] if math.isfinite(row[0]) else -math.inf
        self._group_own.extend(s["own"] for s in samples)
        del self._group_own[: -4 * self.interval]  # the recent steps only
        row[_COUNT] = float(len(samples))
        for k, sample in enumerate(samples[-self.interval :]):
            row[_STEPS + k] = sample["own"]
        step = trainer.global_step
        steps = max(step - self._window_start_step, 1)
        self._window_start_step = step
        # The rows of `windows_per_gather` windows go in one gather, which runs in the background and is read at the
        # end of the next window: a rank that arrives early never stands still for it, at the price of deciding one
        # window later (and the earlier windows of a gather one more window later each).
        self._unsent.append((row, step, steps))
        previous, self._pending = self._pending, None
        if len(self._unsent) == self.windows_per_gather:
            self._pending = self._start_gather(trainer)
        if previous is not None:
            self._decide_gathered(trainer, *previous)

    def _start_gather(self, trainer: pl.Trainer) -> tuple[PendingRows, list[tuple[int, int]]]:
        unsent, self._unsent = self._unsent, []
        row = [x for r, _, _ in unsent for x in r]
        return start_gather_rows(row, trainer.strategy.root_device), [(step, steps) for _, step, steps in unsent]

    def _decide_gathered(self, trainer: pl.Trainer, gathered: PendingRows, windows: list[tuple[int, int]]) -> None:
        rows = gathered.wait()
        width = len(rows[0]) // len(windows)
        for i, (step, steps) in enumerate(windows):
            self._decide(trainer, [r[i * width : (i + 1) * width] for r in rows], step, steps)

    def _decide(self, trainer: pl.Trainer, rows: list[list[float]], step: int, steps: int) -> None:
        own = [r[0] for r in rows]
        result = self.detector.update(
            own, step=step, steps=steps, onset_steps=[r[_RISE] for r in rows], step_own_ms=[r[_STEPS:] for r in rows]
        )
        # The medians of each part, per rank, of the recent windows: the diagnosis of a detection compares the named
        # rank's parts with the others' over the windows since its onset.
        self._windows.append((step, {part: [r[2 * _FIELDS.index(part)] for r in rows] for part in PARTS}))
        diagnoses = {d.rank: self._diagnose(d.rank, d.onset_step, steps) for d in result.detections}
        self._recovered_lost_s += sum(r.lost_s for r in result.recoveries)
        self.lost_s = self._recovered_lost_s + sum(self.detector.open_episodes().values())
        if trainer.is_global_zero:
            if step > self._replayed_through:  # an earlier attempt logged the steps up to there
                self._log(trainer, rows, result, step, diagnoses)
            event_log = get_event_log(trainer)
            for d in result.detections:
                part, excess = diagnoses[d.rank]
                log.warning(
                    "StragglerMonitor: rank %d is %.2fx slower (%s, %s rule) since step %d; its %s grew (%s)",
                    d.rank,
                    d.ratio,
                    d.kind,
                    d.rule,
                    d.onset_step,
                    _PART_NAMES.get(part, part),
                    ", ".join(f"{k} {v:+.1f} ms" for k, v in excess.items()),
                )
                event_log.write(
                    "straggler",
                    suspect_rank=d.rank,
                    ratio=d.ratio,
                    onset_step=d.onset_step,
                    kind=d.kind,
                    own_ms=own[d.rank],
                    fleet_median_ms=result.fleet_median_ms,
                    threshold=d.threshold,
                    noise=result.noise,
                    rule=d.rule,
                    part=part,
                    excess_ms=excess,
                )
            for r in result.recoveries:
                event_log.write("straggler_cleared", suspect_rank=r.rank, lost_s=r.lost_s, recovered=True)
        for d in result.detections:
            self.detections.append(
                {
                    "step": trainer.global_step,
                    "suspect_rank": d.rank,
                    "ratio": d.ratio,
                    "onset_step": d.onset_step,
                    "kind": d.kind,
                    "rule": d.rule,
                    "part": diagnoses[d.rank][0],
                    "excess_ms": diagnoses[d.rank][1],
                }
            )
        for d in result.detections:
            self._act(trainer, d.rank, d.ratio, diagnoses[d.rank][0])

    def _compare_groups(self, trainer: pl.Trainer, replica: Any, step: int) -> None:
        """Replica groups: one row per live group (this rank's median own time since the last exchange, and rank
        ``r`` of each group compared with rank ``r`` of the others), exchanged through the Manager's all-reduce
        inside the step; every group runs the same detector on the same rows, reset whenever the live groups change
        (so a joining group's detector agrees with the others'). A group named a straggler by its own rows leaves
        with ``action="evict"`` (after the vote of this step, :meth:`on_train_batch_end`); the others only record it.

        Collective across the groups (the exchange) and, with ``action="evict"``, inside the group (which ranks found
        their group named), on every rank at the same committed step."""
        own = median(self._group_own) if self._group_own else math.nan
        self._group_own = []
        exchanged = replica.exchange([own])
        named, ratio = False, 0.0
        if exchanged is not None:
            members, slot, rows = exchanged
            if members != self._group_members:
                self._group_members = members
                self.group_detector = StragglerDetector(self.config)
            times = [r[0] for r in rows]
            # Two groups cannot say which of them is slow (each is the other's only reference): compare three or more.
            detections = []
            if len(members) >= MIN_GROUPS_COMPARED:
                result = self.group_detector.update(times, step=step, steps=self.interval)
                detections = result.detections
            for d in detections:
                if trainer.is_global_zero:
                    log.warning(
                        "StragglerMonitor: replica group %s is %.2fx slower than the other groups (%s, %s rule) since"
                        " step %d",
                        members[d.rank],
                        d.ratio,
                        d.kind,
                        d.rule,
                        d.onset_step,
                    )
                    get_event_log(trainer).write(
                        "replica_straggler",
                        replica_id=members[d.rank],
                        ratio=d.ratio,
                        onset_step=d.onset_step,
                        kind=d.kind,
                        rule=d.rule,
                        own_ms=times[d.rank],
                        groups_median_ms=result.fleet_median_ms,
                        live_groups=len(members),
                        evicted=self.action == "evict" and d.rank == slot,
                    )
                self.detections.append(
                    {"step": step, "replica_id": members[d.rank], "ratio": d.ratio, "onset_step": d.onset_step}
                )
                if d.rank == slot:
                    named = True
                    ratio = d.ratio
        if self.action != "evict":
            return
        gathered = trainer.strategy.all_gather(torch.tensor([1.0 if named else 0.0, ratio], dtype=torch.float64))
        flags = gathered.reshape(-1, 2).tolist()  # the same on every rank of the group
        ranks = [r for r, (flag, _) in enumerate(flags) if flag > 0]
        if ranks:
            worst = max(x for flag, x in flags if flag > 0)
            reason = f"replica group {replica.replica_id} {worst:.2f}x the other groups' own step time"
            self._evict_group = (ranks, reason, worst)

    def _diagnose(self, rank: int, onset_step: int, steps: int) -> tuple[str, dict[str, float]]:
        # The windows that end after the onset (the window the onset lies in included); the latest at least.
        episode = [parts for end, parts in self._windows if end > onset_step] or [self._windows[-1][1]]
        return diagnose(episode, rank)

    def _log(
        self,
        trainer: pl.Trainer,
        rows: list[list[float]],
        result: WindowResult,
        step: int,
        diagnoses: dict[int, tuple[str, dict[str, float]]],
    ) -> None:
        if not trainer.loggers:
            return
        metrics: dict[str, float] = {}
        bwd = [r[6] for r in rows]
        fastest_backward = min((b for b in bwd if math.isfinite(b)), default=math.nan)
        for rank, r in enumerate(rows):
            # The rank that arrives last at the all-reduce waits least; the others' extra backward time is waiting.
            wait = r[6] - fastest_backward
            per_rank = {"step": r[8], "own": r[0], "data": r[2], "compute": r[4] + r[6] - wait, "wait": wait}
            if self.log_per_rank:
                metrics.update({f"straggler/{k}_ms/rank_{rank}": v for k, v in per_rank.items()})
        own = [r[0] for r in rows if math.isfinite(r[0])]
        if own:
            metrics.update(
                {
                    "straggler/own_ms/min": min(own),
                    "straggler/own_ms/median": median(own),
                    "straggler/own_ms/max": max(own),
                }
            )
        finite = [(x, i) for i, x in enumerate(result.ratios) if math.isfinite(x)]
        if finite:
            metrics["straggler/max_ratio"] = max(finite)[0]
        named = [(x, i) for x, i in finite if i in self.detector.named]
        if named:  # only a named rank is a suspect: the slowest rank of a healthy fleet is not one
            metrics["straggler/suspect_rank"] = float(max(named)[1])
        metrics["straggler/named_ranks"] = float(len(self.detector.named))
        for part, excess in diagnoses.values():
            # Which part of the named rank's step grew: its excess over the others' in each part, and the part's
            # index in ("data", "compute") under straggler/part.
            metrics.update({f"straggler/excess_ms/{k}": v for k, v in excess.items()})
            if part in _PART_NAMES:
                metrics["straggler/part"] = float(list(_PART_NAMES).index(part))
        metrics["straggler/threshold"] = result.threshold
        metrics["straggler/noise"] = result.noise
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _act(self, trainer: pl.Trainer, rank: int, ratio: float, part: str) -> None:
        # Every rank runs this with the same arguments (the same gathered numbers): the actions are collective.
        if self.action == "log":
            return
        if callable(self.action):
            self.action(trainer, rank, ratio)
            return
        if self.action == "evict":
            reason = f"rank {rank} {ratio:.2f}x the others' own step time; its {_PART_NAMES.get(part, part)} grew"
            evict_node(trainer, ranks=[rank], source="straggler", reason=reason, extra={"ratio": ratio, "part": part})
        checkpoint_and_stop(trainer, exit_code=STRAGGLER_EXIT_CODE, reason="stopped")
