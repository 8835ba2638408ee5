"""Retention never deletes the checkpoint being written or the newest committed one (Lightning #14035)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_ft.checkpoint import repoint_last
from lightning_ft.checkpoint.internal import Retention, is_committed
from tests.checkpoint.support import save

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


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
    assert is_committed(newest), "the only committed checkpoint was deleted while its successor was in flight"

    save(in_flight, 6)
    writing.path = None
    retention.on_commit(in_flight)
    assert not newest.exists() and not older.exists()
    assert is_committed(in_flight)


def test_a_removal_asked_for_while_a_save_is_in_flight_waits_for_that_commit_as_under_ddp_strategy(tmp_path):
    # ModelCheckpoint(monitor=..., save_top_k=1, save_last=True): the top-k file of step 2 and last.ckpt (step 2,
    # committed after it, so the newest). At step 4 Lightning asks for the new top-k file, then to delete the step-2
    # one. Under DDPStrategy the new file is written by then; here it is in flight. Deleted now, a crash before the
    # commit leaves last.ckpt, whose ModelCheckpoint state names the step-2 file as the best: a file that is gone.
    top_k, last, replacement = (
        tmp_path / "epoch=0-step=2.ckpt",
        tmp_path / "last.ckpt",
        tmp_path / "epoch=1-step=4.ckpt",
    )
    save(top_k, 2)
    save(last, 2)
    writing = InFlight()
    retention = Retention(in_flight=writing)
    writing.path = replacement
    retention.remove(top_k)
    assert is_committed(top_k), "the top-k checkpoint was deleted before its replacement was committed"

    # The commit callback runs in the writer thread while the writer still reports the save in flight (its future is
    # not done until the callback returns): the removal that waited runs now, not at some later commit.
    save(replacement, 4)
    retention.on_commit(replacement)
    assert not top_k.exists()
    assert is_committed(replacement) and is_committed(last)


def test_removing_a_checkpoint_that_is_still_being_written_waits_for_its_commit(tmp_path):
    in_flight = tmp_path / "step=2"
    writing = InFlight()
    retention = Retention(in_flight=writing)
    writing.path = in_flight
    in_flight.mkdir()
    retention.remove(in_flight)
    assert in_flight.exists()


def test_a_last_save_is_written_at_the_path_lightning_asks_for_even_when_a_checkpoint_holds_its_state(tmp_path):
    # With save_last=True Lightning writes `last` as a file of its own: a later write to one path never reaches the
    # other (no link, no hard link), so the plan is always the path itself.
    first = save(tmp_path / "step=1", 1)
    writing = InFlight()
    retention = Retention(in_flight=writing, in_flight_step=lambda: 2)
    link = tmp_path / "last.ckpt"
    assert retention.plan_last(link, 1, same_state=first) == link
    writing.path = tmp_path / "step=2"
    assert retention.plan_last(link, 2, same_state=writing.path) == link
    assert not link.exists() and not link.is_symlink()  # nothing is linked: the caller writes there


def test_a_last_file_that_lightning_ft_did_not_write_is_left_alone(tmp_path):
    foreign = tmp_path / "last.ckpt"
    foreign.write_bytes(b"a Lightning file of another run")
    retention = Retention(in_flight=InFlight())
    with pytest.warns(UserWarning, match="not a checkpoint lightning-ft wrote"):
        assert retention.plan_last(foreign, 4) is None
    assert foreign.read_bytes() == b"a Lightning file of another run"


def test_removing_a_link_deletes_the_link_and_leaves_its_target(tmp_path):
    target = save(tmp_path / "step=1", 1)
    retention = Retention(in_flight=InFlight())
    link = tmp_path / "last.ckpt"
    os.symlink(target.name, link)  # Lightning's save_last="link"
    retention.remove(link)
    assert not link.exists() and not link.is_symlink()
    assert is_committed(target)


def test_retention_leaves_alone_what_lightning_asks_to_remove_but_lightning_ft_did_not_write(tmp_path):
    save(tmp_path / "step=3", 3)
    old_file = tmp_path / "epoch=0-step=1.ckpt"  # written by an earlier run under another strategy
    old_file.write_bytes(b"a Lightning checkpoint")
    foreign = tmp_path / "epoch=0-step=2.ckpt"
    foreign.mkdir()
    (foreign / "data.bin").write_bytes(b"another tool's")
    retention = Retention(in_flight=InFlight())
    with pytest.warns(UserWarning, match="not a checkpoint lightning-ft wrote"):
        retention.remove(old_file)
        retention.remove(foreign)
    assert old_file.read_bytes() == b"a Lightning checkpoint"
    assert (foreign / "data.bin").read_bytes() == b"another tool's"


def test_the_last_link_never_replaces_a_file_or_folder_that_is_not_a_link(tmp_path):
    target = save(tmp_path / "step=1", 1)
    (tmp_path / "last.ckpt").write_bytes(b"a Lightning last.ckpt")
    with pytest.raises(FileExistsError, match="not a link"):
        repoint_last(tmp_path, target, name="last.ckpt")
    assert (tmp_path / "last.ckpt").read_bytes() == b"a Lightning last.ckpt"
    (tmp_path / "last-v1.ckpt").mkdir()
    with pytest.raises(FileExistsError, match="not a link"):
        repoint_last(tmp_path, target, name="last-v1.ckpt")
    assert (tmp_path / "last-v1.ckpt").is_dir()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
