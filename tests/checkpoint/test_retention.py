"""Retention never deletes the checkpoint being written or the newest committed one (Lightning #14035)."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_ft.checkpoint import Retention, is_committed
from tests.checkpoint.support import save


class InFlight:
    """What ``AsyncCheckpointer.in_flight`` reports, set by the test."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def __call__(self) -> Path | None:
        return self.path


def test_removal_of_the_newest_committed_checkpoint_waits_for_the_next_commit(tmp_path):
    older, newest, in_flight = tmp_path / "step=2", tmp_path / "step=4", tmp_path / "step=6"
    save(older, 2)
    save(newest, 4)
    writing = InFlight()
    retention = Retention(in_flight=writing)
    writing.path = in_flight

    # ModelCheckpoint(save_top_k=1) asks to drop both older ones while step 6 is still being written.
    retention.remove(older)
    retention.remove(newest)
    assert not older.exists()
    assert is_committed(newest), "the only committed checkpoint was deleted while its successor was in flight"

    save(in_flight, 6)
    writing.path = None
    retention.on_commit(in_flight)
    assert not newest.exists()
    assert is_committed(in_flight)


def test_removing_a_checkpoint_that_is_still_being_written_waits_for_its_commit(tmp_path):
    in_flight = tmp_path / "step=2"
    writing = InFlight()
    retention = Retention(in_flight=writing)
    writing.path = in_flight
    in_flight.mkdir()
    retention.remove(in_flight)
    assert in_flight.exists()


def test_the_last_link_follows_the_newest_commit_and_never_points_at_a_save_in_flight(tmp_path):
    first, second = save(tmp_path / "step=1", 1), tmp_path / "step=2"
    writing = InFlight()
    retention = Retention(in_flight=writing)
    link = tmp_path / "last.ckpt"

    retention.request_last_link(link)
    assert os.readlink(link) == "step=1"

    writing.path = second  # the next save is being written: the link stays on the committed one
    second.mkdir()
    retention.request_last_link(link)
    assert os.readlink(link) == "step=1"

    save(second, 2)
    writing.path = None
    retention.on_commit(second)
    assert os.readlink(link) == "step=2" and is_committed(link)
    assert is_committed(first)


def test_removing_a_link_deletes_the_link_and_leaves_its_target(tmp_path):
    target = save(tmp_path / "step=1", 1)
    retention = Retention(in_flight=InFlight())
    link = tmp_path / "last.ckpt"
    retention.request_last_link(link)
    retention.remove(link)
    assert not link.exists() and not link.is_symlink()
    assert is_committed(target)
