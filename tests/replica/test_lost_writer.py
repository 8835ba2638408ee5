"""The save a lost writer group left unfinished: the group that writes next removes it at once when its writer is
provably gone, names it in one line otherwise, and never touches a checkpoint, a save in flight or what is not ours.

The leftovers are made by the real save path: a one-file save's placeholder and staging folder, written by a child
process that is then SIGKILLed (the writer lost mid-save), and a folder save's in-progress record."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
from pathlib import Path

from lightning_ft.checkpoint.commit import COMMIT_MARKER
from lightning_ft.checkpoint.file_commit import prepare_file
from lightning_ft.checkpoint.in_progress import is_placeholder, mark_in_flight, unmark_in_flight, write_placeholder
from lightning_ft.checkpoint.swap import make_staging, swap_path
from lightning_ft.checkpoint.unfinished import unfinished_saves as leftovers
from lightning_ft.replica.lost_writer import settle_lost_writer


def _begin_save_and_stop(path: str, ready) -> None:
    """A writer's save of ``path`` up to its data: the placeholder, then the staging folder with its record."""
    target = Path(path)
    write_placeholder(target, step=20, run_id="run")
    staged = prepare_file(target, step=20, run_id="run")
    (staged / "part").write_bytes(b"\0" * 1024)
    ready.set()
    signal.pause()


def _killed_mid_save(path: Path) -> int:
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    writer = ctx.Process(target=_begin_save_and_stop, args=(str(path), ready))
    writer.start()
    assert ready.wait(60)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    return writer.pid


def test_the_unfinished_save_of_a_writer_killed_mid_save_is_removed_at_once(tmp_path: Path, caplog) -> None:
    target = tmp_path / "epoch=0-step=20.ckpt"
    pid = _killed_mid_save(target)
    assert is_placeholder(target)
    found = leftovers(tmp_path)
    assert {f.path.name for f in found} == {target.name, *(p.name for p in tmp_path.glob(".*lft-new-*"))}
    assert all(f.pid == pid and f.host == socket.gethostname() and f.writer_gone for f in found)
    committed = tmp_path / "epoch=0-step=10.ckpt"
    committed.mkdir()
    (committed / COMMIT_MARKER).write_text("{}")
    user = tmp_path / "notes"
    user.mkdir()
    with caplog.at_level(logging.INFO, logger="lightning_ft.replica.lost_writer"):
        removed, kept = settle_lost_writer([tmp_path], lost_writer="0")
    assert kept == [] and {p.name for p in removed} == {f.path.name for f in found}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=10.ckpt", "notes"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # removed: nothing to say on the console


def test_a_save_whose_writer_still_runs_or_ran_elsewhere_is_named_in_one_line_and_kept(tmp_path: Path, caplog) -> None:
    # A hung writer (its process runs: it may still finish the save) and one on another host (nothing proves it gone).
    running = tmp_path / "epoch=0-step=30.ckpt"
    running.write_bytes(
        b"lightning-ft placeholder\n" + f'{{"pid": {os.getppid()}, "host": "{socket.gethostname()}"}}'.encode()
    )
    elsewhere = make_staging(
        tmp_path / "epoch=0-step=40.ckpt", target=tmp_path / "epoch=0-step=40.ckpt", step=40, run_id=None
    )
    (elsewhere / "lightning_ft.in_progress").write_text('{"pid": 1, "host": "another-node"}')
    with caplog.at_level(logging.INFO, logger="lightning_ft.replica.lost_writer"):
        removed, kept = settle_lost_writer([tmp_path], lost_writer="0")
    assert removed == [] and {k.path for k in kept} == {running, elsewhere}
    assert running.exists() and elsewhere.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(running) in warnings[0] and str(elsewhere) in warnings[0] and "never loaded" in warnings[0]


def test_a_save_in_flight_in_this_process_is_never_touched(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    pid = _killed_mid_save(target)  # the same name, now being written again by this process
    mark_in_flight(target)
    try:
        staged = swap_path(target, "new", "0" * 16)
        staged.mkdir()
        assert leftovers(tmp_path) == []
        assert settle_lost_writer([tmp_path], lost_writer="0") == ([], [])
    finally:
        unmark_in_flight(target)
    assert is_placeholder(target) and pid > 0
