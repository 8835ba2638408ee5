"""Finding committed checkpoints, verifying them, cleaning up, and the atomic ``last`` link."""

from __future__ import annotations

import json
import os
import threading

import pytest

from lightning_ft.checkpoint import cleanup_uncommitted, latest_committed, list_committed, repoint_last, verify
from lightning_ft.checkpoint.internal import COMMIT_MARKER, METADATA_FILE, is_committed
from tests.checkpoint.support import folders_only, save, uncommitted

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


def test_discovery_sees_committed_checkpoints_by_step_and_ignores_uncommitted_ones_and_the_last_link(tmp_path):
    folders_only()
    save(tmp_path / "b", 20)
    save(tmp_path / "a", 10)
    uncommitted(tmp_path / "c", 30)
    repoint_last(tmp_path, tmp_path / "b")
    found = list_committed(tmp_path)
    assert [(c.path.name, c.step) for c in found] == [("a", 10), ("b", 20)]
    assert latest_committed(tmp_path).path == tmp_path / "b"
    assert latest_committed(tmp_path, exclude=[tmp_path / "b"]).path == tmp_path / "a"
    assert latest_committed(tmp_path / "missing") is None
    assert is_committed(tmp_path / "last") and not is_committed(tmp_path / "c")


def test_verify_finds_nothing_wrong_in_a_sound_checkpoint_and_reports_a_missing_marker(tmp_path):
    folders_only()
    assert verify(save(tmp_path / "sound", 1)) == []
    problems = verify(uncommitted(tmp_path / "interrupted", 2))
    assert len(problems) == 1 and COMMIT_MARKER in problems[0] and "interrupted" in problems[0]
    assert verify(tmp_path / "missing") != []


def test_cleanup_removes_interrupted_saves_of_ours_except_those_kept(tmp_path):
    folders_only()
    save(tmp_path / "done", 1)
    uncommitted(tmp_path / "crashed", 2)
    uncommitted(tmp_path / "in-flight", 3)
    repoint_last(tmp_path, tmp_path / "done")
    removed = cleanup_uncommitted(tmp_path, keep=[tmp_path / "in-flight"])
    assert removed == [tmp_path / "crashed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "in-flight", "last"]


def test_the_marker_says_whether_the_checkpoint_holds_the_full_state_so_listing_reads_only_markers(tmp_path):
    folders_only()
    save(tmp_path / "full", 2, metadata={"step": 2, "full_state": True})
    save(tmp_path / "weights", 3, metadata={"step": 3, "full_state": False})
    save(tmp_path / "unsaid", 1)
    save(tmp_path / "no-step", 0, metadata={})
    for name in ("full", "weights", "unsaid", "no-step"):
        (tmp_path / name / METADATA_FILE).write_text("unreadable")  # listing must not need it
    found = [(c.path.name, c.step, c.full_state) for c in list_committed(tmp_path)]
    assert found == [("no-step", None, None), ("unsaid", 1, None), ("full", 2, True), ("weights", 3, False)]
    marker = json.loads((tmp_path / "weights" / COMMIT_MARKER).read_text())
    assert marker["step"] == 3 and marker["full_state"] is False


def test_repoint_last_is_atomic_so_the_link_always_resolves_to_a_committed_checkpoint(tmp_path):
    folders_only()
    targets = [save(tmp_path / "step=1", 1), save(tmp_path / "step=2", 2)]
    link = repoint_last(tmp_path, targets[0])
    assert os.readlink(link) == "step=1"  # relative, so the folder can move
    failures = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            if not is_committed(link):
                failures.append("link did not resolve")

    thread = threading.Thread(target=reader, name="test-last-reader")
    thread.start()
    try:
        for i in range(300):
            repoint_last(tmp_path, targets[i % 2])
    finally:
        stop.set()
        thread.join()
    assert failures == []
    assert link.resolve() == targets[1].resolve()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
