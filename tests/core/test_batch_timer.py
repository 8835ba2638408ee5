"""BatchTimer: the one account of productive time, data wait and checkpoint stalls, driven by a fake clock."""

from __future__ import annotations

import pytest

from lightning_ft.batch_timer import BatchTimer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_productive_time_runs_from_batch_start_to_end_and_the_gap_is_data_wait():
    clock = Clock()
    timer = BatchTimer(clock)
    timer.epoch_start(count_wait=True)
    clock.now = 1.0
    timer.batch_start()
    clock.now = 3.0
    timer.batch_end()
    clock.now = 3.5
    timer.batch_start()
    clock.now = 5.5
    timer.batch_end()
    assert (timer.productive_s, timer.data_wait_s, timer.stall_s) == (4.0, 1.5, 0.0)
    assert timer.drain() == (4.0, 1.5, 0.0)
    assert timer.drain() == (0.0, 0.0, 0.0) and not timer.pending()
    timer.add_stall(0.25)  # the save at the end of training: no batch start follows it
    assert timer.pending() and timer.drain() == (0.0, 0.0, 0.25)


def test_a_measured_save_stall_is_taken_out_of_the_data_wait():
    clock = Clock()
    timer = BatchTimer(clock)
    timer.batch_start()
    clock.now = 1.0
    timer.batch_end()
    clock.now = 3.0  # gap of 2 s, of which the save call blocked 1.5 s
    timer.batch_start(stall_s=1.5)
    assert timer.stall_s == 1.5 and timer.data_wait_s == pytest.approx(0.5)


def test_an_unmeasured_save_counts_its_excess_over_the_usual_gap_as_stall():
    clock = Clock()
    timer = BatchTimer(clock)
    timer.epoch_start(count_wait=False)
    for gap in (0.1, 0.1, 0.1):
        clock.now += gap
        timer.batch_start()
        clock.now += 1.0
        timer.batch_end()
    data_before = timer.data_wait_s
    clock.now += 0.9  # a save ran in this gap
    timer.batch_start(saved=True)
    assert timer.stall_s == pytest.approx(0.8)
    assert timer.data_wait_s - data_before == pytest.approx(0.1)


def test_the_first_gap_of_an_epoch_and_the_gap_after_validation_can_be_left_out():
    clock = Clock()
    timer = BatchTimer(clock)
    timer.epoch_start(count_wait=False)
    clock.now = 5.0
    timer.batch_start()
    timer.batch_end()
    timer.pause()
    clock.now = 9.0
    timer.batch_start()
    assert timer.data_wait_s == 0.0
