"""The hang watchdog: a thread on every rank that ends a process which stopped making progress.

No completed training step (or validation batch) within ``hang_timeout_s`` (``first_step_timeout_s`` until the first
step of an attempt completes, which covers set-up, restore and compilation) means the rank is stuck, either itself
(a data read that never returns, a dead NFS mount) or waiting in a collective for a peer that is. The watchdog then
names the rank(s) that stopped first from every rank's heartbeat (:mod:`~lightning_ft.fault.heartbeat`), dumps every
thread's stack into ``<default_root_dir>/lightning-ft/hangs/attempt<A>-rank<R>.txt`` and to stderr, writes a ``hang``
and an ``attempt_end`` event, and ends the process with ``os._exit(HANG_EXIT_CODE)``: a main thread stuck in a system
call or a collective cannot be interrupted, and a non-zero exit makes torchrun restart the worker group.

The same thread enforces the preemption deadline: once the ranks agreed to stop, a process still alive ``grace_s``
after the signal exits with the policy's code even if its checkpoint has not committed.

A hang is caught only while the interpreter can run the watchdog thread, which is the case for anything that waits in
a system call or a collective (they release the interpreter lock); C code that spins with the lock held is not.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_ft.events import EventLog
from lightning_ft.fault.heartbeat import HeartbeatBoard, Progress, name_culprits

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 124
"""Exit code of a process whose watchdog fired; the code coreutils' ``timeout`` uses for "timed out"."""

THREAD_NAME = "lightning-ft-watchdog"


class Watchdog:
    """Watches one rank's :class:`~lightning_ft.fault.heartbeat.Progress`.

    Args:
        progress: what the training loop reports.
        rank: this process's global rank.
        hang_timeout_s: seconds without a completed step before a hang (after the first step of the attempt).
        first_step_timeout_s: the same, until the first training step of the attempt has completed.
        board: every rank's heartbeats (``None``: this rank alone; a hang then names this rank).
        event_log: where ``hang`` and ``attempt_end`` go (``None``: the log only).
        stacks_path: file for the stack dump (``None``: stderr only).
        clock: Unix time source; tests inject one and call :meth:`check` themselves instead of :meth:`start`.
        exit_fn: ends the process (``os._exit``; tests inject a recorder).
        on_tick: called with the time at every poll, in the watchdog thread, before judging (the preemption handling
            arms its deadline from there).
        before_hang_exit: called in the watchdog thread when it fires, before ``hang`` and ``attempt_end`` are written
            (the strategy writes the ``progress`` its stuck main thread measured since its last line).

    Example::

        progress = Progress()
        watchdog = Watchdog(progress=progress, rank=0, hang_timeout_s=600, first_step_timeout_s=1800)
        watchdog.start()
        ...  # progress.complete("batch_end", step) after every training step
        watchdog.stop()
    """

    def __init__(
        self,
        *,
        progress: Progress,
        rank: int,
        hang_timeout_s: float,
        first_step_timeout_s: float,
        board: HeartbeatBoard | None = None,
        event_log: EventLog | None = None,
        stacks_path: Path | None = None,
        clock: Callable[[], float] = time.time,
        exit_fn: Callable[[int], Any] = os._exit,
        on_tick: Callable[[float], None] | None = None,
        before_hang_exit: Callable[[], None] | None = None,
    ) -> None:
        self.progress = progress
        self.rank = rank
        self.hang_timeout_s = hang_timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        self.board = board
        self.event_log = event_log
        self.stacks_path = stacks_path
        self._clock = clock
        self._exit = exit_fn
        self._on_tick = on_tick
        self._before_hang_exit = before_hang_exit
        self.poll_s = min(1.0, hang_timeout_s / 10.0)
        self.publish_s = max(self.poll_s, min(30.0, hang_timeout_s / 20.0))
        self._last_publish = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._suspended = False
        self._deadline: tuple[float, int, Callable[[], None]] | None = None
        self.fired: dict[str, Any] | None = None
        """The hang report once the watchdog fired."""

    @property
    def silent_after_s(self) -> float:
        """A peer whose heartbeat is older than this is silent (dead, or frozen)."""
        return 3.0 * self.publish_s + 2.0 * self.poll_s

    def start(self) -> None:
        """Start the thread (idempotent); it publishes this rank's heartbeat at once."""
        if self._thread is None:
            self._stop.clear()
            self._publish(self._clock(), force=True)
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it. Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def suspend(self) -> None:
        """Stop judging hangs (a stop was agreed: the deadline of :meth:`arm_deadline` governs from now on)."""
        self._suspended = True

    def arm_deadline(self, at: float, exit_code: int, on_expire: Callable[[], None]) -> None:
        """At Unix time ``at``, call ``on_expire()`` and end the process with ``exit_code`` (first call wins)."""
        if self._deadline is None:
            self._deadline = (at, exit_code, on_expire)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = self._clock()
            self._publish(now)
            if self._on_tick is not None:
                try:
                    self._on_tick(now)
                except Exception as err:  # noqa: BLE001 - judging hangs matters more
                    log.debug("lightning-ft watchdog: on_tick failed: %s", err)
            self.check(now)

    def _publish(self, now: float, *, force: bool = False) -> None:
        if self.board is None or (not force and now - self._last_publish < self.publish_s):
            return
        self._last_publish = now
        try:
            self.board.publish(self.progress.heartbeat(self.rank))
        except Exception as err:  # noqa: BLE001 - a store hiccup must not end the watchdog
            log.debug("lightning-ft watchdog: heartbeat not published: %s", err)

    def timeout_s(self) -> float:
        """The limit in force: ``first_step_timeout_s`` until the attempt's first training step completed."""
        return self.hang_timeout_s if self.progress.steps > 0 else self.first_step_timeout_s

    def check(self, now: float | None = None) -> bool:
        """Judge once; fire (and end the process) on a hang or an expired deadline. True if it fired."""
        if self.fired is not None:
            return True
        now = self._clock() if now is None else now
        if self._deadline is not None and now >= self._deadline[0]:
            _, code, on_expire = self._deadline
            self.fired = {"deadline": True}
            try:
                on_expire()
            finally:
                _flush()
                self._exit(code)
            return True
        if self._suspended:
            return False
        idle_s = now - self.progress.completed_time
        limit = self.timeout_s()
        if idle_s < limit:
            return False
        self._fire(now, idle_s, limit)
        return True

    def diagnose(self, now: float) -> dict[str, Any]:
        """Every rank's heartbeat and the culprits (see :func:`~lightning_ft.fault.heartbeat.name_culprits`)."""
        own = self.progress.heartbeat(self.rank)
        beats = {self.rank: own}
        if self.board is not None:
            self._publish(now, force=True)
            beats = self.board.read()
            beats[self.rank] = own
        found = name_culprits(beats, now=now, silent_after_s=self.silent_after_s)
        found["heartbeats"] = {
            str(r): (
                None
                if b is None
                else {
                    "points": b.points,
                    "step": b.step,
                    "point": b.point,
                    "time": b.point_time,
                    "in_collective_since": b.in_collective_since,
                    "collective": b.collective,
                }
            )
            for r, b in sorted(beats.items())
        }
        return found

    def _fire(self, now: float, idle_s: float, limit: float) -> None:
        report = {"idle_s": idle_s, "timeout_s": limit, "first_step": self.progress.steps == 0}
        try:
            report.update(self.diagnose(now))
        except Exception as err:  # noqa: BLE001 - the exit below must happen whatever the diagnosis did
            report.update({"ranks": [self.rank], "first_rank": self.rank, "error": f"{type(err).__name__}: {err}"})
        self.fired = report
        try:
            report["stacks_path"] = self._dump_stacks()
            log.error(
                "lightning-ft watchdog: rank %d made no progress for %.0f s (limit %.0f s); stopped first: rank(s) %s."
                " Stacks: %s. Exiting with code %d.",
                self.rank,
                idle_s,
                limit,
                report.get("ranks"),
                report.get("stacks_path"),
                HANG_EXIT_CODE,
            )
            if self._before_hang_exit is not None:
                try:
                    self._before_hang_exit()
                except Exception as err:  # noqa: BLE001 - the hang's own record matters more
                    log.debug("lightning-ft watchdog: before_hang_exit failed: %s", err)
            if self.event_log is not None:
                self.event_log.write("hang", step=self.progress.step, **report)
                self.event_log.write("attempt_end", step=self.progress.step, reason="hung", exit_code=HANG_EXIT_CODE)
        finally:
            _flush()
            self._exit(HANG_EXIT_CODE)

    def _dump_stacks(self) -> str | None:
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, OSError, ValueError):  # stderr without a file descriptor (captured)
            pass
        if self.stacks_path is None:
            return None
        try:
            self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.stacks_path, "w") as f:
                f.write(f"lightning-ft watchdog: rank {self.rank}, pid {os.getpid()}, {time.ctime()}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            return str(self.stacks_path)
        except OSError as err:  # the folder itself may sit on the dead mount
            log.error("lightning-ft watchdog: could not write %s: %s", self.stacks_path, err)
            return None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
