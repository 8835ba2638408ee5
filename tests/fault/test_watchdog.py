"""The hang watchdog, driven by an injected clock: when it fires, whom it names, what it leaves behind."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_ft.events import EventLog, read_events
from lightning_ft.fault.heartbeat import Heartbeat, HeartbeatBoard, Progress, name_culprits
from lightning_ft.fault.internal import HANG_EXIT_CODE
from lightning_ft.fault.watchdog import Watchdog


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class DictStore:
    """The three calls of torch.distributed.Store the board uses, on a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


class Exited(Exception):
    pass


def make(tmp_path, clock, *, rank=0, board=None, hang=10.0, first=30.0):
    codes: list[int] = []

    def exit_fn(code: int) -> None:
        codes.append(code)

    log = EventLog(tmp_path, rank=rank, run_id="r", attempt=0)
    progress = Progress(clock)
    dog = Watchdog(
        progress=progress,
        rank=rank,
        hang_timeout_s=hang,
        first_step_timeout_s=first,
        board=board,
        event_log=log,
        stacks_path=tmp_path / "stacks" / f"rank{rank}.txt",
        clock=clock,
        exit_fn=exit_fn,
    )
    return dog, progress, codes


def test_the_first_step_gets_the_longer_timeout_and_later_steps_the_shorter_one(tmp_path):
    clock = Clock()
    dog, progress, codes = make(tmp_path, clock, hang=10.0, first=30.0)
    clock.now += 29.0
    assert not dog.check() and codes == []  # set-up and the first step may take up to 30 s
    progress.complete("batch_end", 1, training=True)
    clock.now += 9.5
    assert not dog.check()
    progress.complete("batch_end", 2, training=True)
    clock.now += 10.5
    assert dog.check() and codes == [HANG_EXIT_CODE]
    assert dog.fired["idle_s"] == pytest.approx(10.5) and dog.fired["timeout_s"] == 10.0


def test_a_hung_first_step_is_caught_after_the_first_step_timeout(tmp_path):
    clock = Clock()
    dog, _, codes = make(tmp_path, clock, hang=10.0, first=30.0)
    clock.now += 30.0
    assert dog.check() and codes == [HANG_EXIT_CODE] and dog.fired["first_step"] is True


def test_validation_batches_count_as_progress(tmp_path):
    clock = Clock()
    dog, progress, codes = make(tmp_path, clock, hang=10.0, first=10.0)
    for _ in range(5):
        clock.now += 8.0
        progress.complete("validation_batch_end", 0, training=False)
        assert not dog.check()
    assert codes == []


def test_the_rank_stuck_in_a_data_read_is_named_not_the_rank_waiting_for_it_in_the_all_reduce(tmp_path):
    clock = Clock()
    store = DictStore()
    boards = [HeartbeatBoard(store, prefix="hb/run/attempt0", world_size=2) for _ in range(2)]
    dogs = [make(tmp_path / str(r), clock, rank=r, board=boards[r])[0:2] for r in range(2)]
    (dog0, p0), (dog1, p1) = dogs
    for step in range(1, 4):
        for p in (p0, p1):
            p.mark("batch_start", step - 1)
            p.mark("before_backward", step - 1)
            p.mark("after_backward", step - 1)
            p.complete("batch_end", step, training=True)
        clock.now += 0.1
    # Rank 1 never returns from its next data read; rank 0 starts step 4 and waits in backward's all-reduce.
    clock.now += 0.05
    p0.mark("batch_start", 3)
    p0.mark("before_backward", 3)
    for dog in (dog0, dog1):
        dog._publish(clock.now, force=True)
    clock.now += 11.0
    for dog in (dog0, dog1):
        dog._publish(clock.now, force=True)  # both processes are alive: their watchdog threads publish
    assert dog0.check() and dog1.check()
    for dog in (dog0, dog1):
        assert dog.fired["ranks"] == [1] and dog.fired["first_rank"] == 1 and dog.fired["silent"] == []
        assert dog.fired["heartbeats"]["1"]["point"] == "batch_end"
    events = [e for e in read_events(tmp_path / "0") if e["event"] == "hang"]
    assert events and events[0]["ranks"] == [1] and events[0]["idle_s"] >= 10.0


def test_a_rank_that_stopped_publishing_is_named_before_ranks_that_are_merely_behind():
    now = 100.0
    beats = {
        0: Heartbeat(rank=0, points=9, step=3, point="before_backward", point_time=50.0, alive_time=99.0),
        1: Heartbeat(rank=1, points=5, step=2, point="batch_end", point_time=40.0, alive_time=99.5),
        2: Heartbeat(rank=2, points=9, step=3, point="before_backward", point_time=45.0, alive_time=60.0),
        3: None,
    }
    found = name_culprits(beats, now=now, silent_after_s=10.0)
    assert found["silent"] == [2, 3]
    assert found["ranks"] == [3, 2] and found["first_rank"] == 3  # never published: stopped first
    without_silent = name_culprits({r: beats[r] for r in (0, 1)}, now=now, silent_after_s=10.0)
    assert without_silent["ranks"] == [1] and without_silent["last_progress_time"] == 40.0


def test_ties_are_ordered_by_who_stopped_first():
    beats = {
        0: Heartbeat(rank=0, points=7, step=2, point="batch_start", point_time=20.0, alive_time=99.0),
        1: Heartbeat(rank=1, points=7, step=2, point="batch_start", point_time=18.0, alive_time=99.0),
    }
    assert name_culprits(beats, now=100.0, silent_after_s=10.0)["ranks"] == [1, 0]


def test_a_hang_writes_the_stacks_of_every_thread_a_hang_event_and_attempt_end(tmp_path):
    clock = Clock()
    dog, _, codes = make(tmp_path, clock, hang=5.0, first=5.0)
    parked = threading.Event()
    worker = threading.Thread(target=parked.wait, name="lightning-ft-test-parked", daemon=True)
    worker.start()
    try:
        clock.now += 6.0
        dog.check()
    finally:
        parked.set()
        worker.join()
    text = (tmp_path / "stacks" / "rank0.txt").read_text()
    assert "Thread" in text and "wait" in text and text.count("File ") >= 2
    events = read_events(tmp_path)
    hang = next(e for e in events if e["event"] == "hang")
    assert hang["stacks_path"] == str(tmp_path / "stacks" / "rank0.txt") and hang["ranks"] == [0]
    end = next(e for e in events if e["event"] == "attempt_end")
    assert end["reason"] == "hung" and end["exit_code"] == HANG_EXIT_CODE
    assert codes == [HANG_EXIT_CODE]
    dog.check()
    assert codes == [HANG_EXIT_CODE]  # fires once


def test_the_preemption_deadline_ends_the_process_with_the_policy_code_even_while_hang_judging_is_suspended(tmp_path):
    clock = Clock()
    dog, _, codes = make(tmp_path, clock, hang=100.0, first=100.0)
    expired = []
    dog.suspend()
    dog.arm_deadline(clock.now + 20.0, 75, lambda: expired.append(clock.now))
    dog.arm_deadline(clock.now + 1.0, 99, lambda: None)  # the first deadline wins
    clock.now += 19.0
    assert not dog.check() and codes == []
    clock.now += 2.0
    assert dog.check() and codes == [75] and expired


def test_the_thread_publishes_heartbeats_and_stops(tmp_path):
    store = DictStore()
    board = HeartbeatBoard(store, prefix="hb", world_size=1)
    dog, progress, codes = make(tmp_path, time.time, board=board, hang=5.0, first=5.0)
    dog.start()
    try:
        progress.complete("batch_end", 1, training=True)
        deadline = time.time() + 10
        while time.time() < deadline and board.read()[0].points < 1:
            time.sleep(0.05)
    finally:
        dog.stop()
    assert board.read()[0].points == 1 and codes == []
