"""Finding committed checkpoints, refusing damaged or unsafe ones, cleaning up, and the atomic ``last`` link."""

from __future__ import annotations

import json
import os
import pickle
import threading
import zlib
from pathlib import Path

import pytest
import torch
import yaml

from lightning_ft.checkpoint import (
    COMMIT_MARKER,
    METADATA_FILE,
    AsyncCheckpointer,
    CorruptCheckpointError,
    FormatVersionError,
    UncommittedCheckpointError,
    UnsafeCheckpointError,
    cleanup_uncommitted,
    is_committed,
    latest_committed,
    list_committed,
    load_checkpoint,
    repoint_last,
    verify,
)


def save(path: Path, step: int, state: dict | None = None) -> Path:
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(path, state or {"w": torch.full((4,), float(step))}, metadata={"step": step})
    finally:
        checkpointer.close()
    return path


def uncommitted(path: Path, step: int) -> Path:
    save(path, step)
    (path / COMMIT_MARKER).unlink()
    return path


def data_files(path: Path) -> list[Path]:
    ours = {COMMIT_MARKER, METADATA_FILE, ".snapshot_metadata"}
    return sorted((p for p in path.rglob("*") if p.is_file() and p.name not in ours), key=lambda p: p.stat().st_size)


class CreatesFileWhenUnpickled:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def test_discovery_sees_committed_checkpoints_by_step_and_ignores_uncommitted_ones_and_the_last_link(tmp_path):
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


def test_loading_an_uncommitted_checkpoint_is_refused_naming_the_newest_committed_one(tmp_path):
    save(tmp_path / "step=10", 10)
    uncommitted(tmp_path / "step=20", 20)
    with pytest.raises(UncommittedCheckpointError) as raised:
        load_checkpoint(tmp_path / "step=20")
    assert str(tmp_path / "step=20") in str(raised.value)
    assert str(tmp_path / "step=10") in str(raised.value)
    with pytest.raises(UncommittedCheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step=30")


def test_an_unknown_format_version_is_refused(tmp_path):
    path = save(tmp_path / "c", 1)
    document = json.loads((path / METADATA_FILE).read_text())
    document["format_version"] = 99
    data = json.dumps(document).encode()
    (path / METADATA_FILE).write_bytes(data)
    marker = json.loads((path / COMMIT_MARKER).read_text())
    marker["metadata_crc32"] = zlib.crc32(data)
    (path / COMMIT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(FormatVersionError, match="99"):
        load_checkpoint(path)


def test_a_corrupted_byte_in_a_shard_file_is_named_by_load_and_verify(tmp_path):
    path = save(tmp_path / "c", 1, {"model": {"weight": torch.randn(512, 512), "bias": torch.randn(8)}})
    target = data_files(path)[-1]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    relative = str(target.relative_to(path))
    with pytest.raises(CorruptCheckpointError) as raised:
        load_checkpoint(path)
    assert "model/weight" in str(raised.value) and relative in str(raised.value)
    problems = verify(path)
    assert len(problems) == 1 and "model/weight" in problems[0] and "checksum" in problems[0]
    assert load_checkpoint(path, verify_checksums=False).state["model"]["bias"].shape == (8,)


def test_a_missing_shard_file_is_named(tmp_path):
    path = save(tmp_path / "c", 1, {"model": {"weight": torch.randn(512, 512)}})
    target = data_files(path)[-1]
    target.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing") as raised:
        load_checkpoint(path)
    assert "model/weight" in str(raised.value) and str(target.relative_to(path)) in str(raised.value)
    assert any("model/weight" in p for p in verify(path))


def test_a_metadata_file_replaced_by_a_pickle_is_refused_without_unpickling(tmp_path):
    path = save(tmp_path / "c", 1)
    sentinel = tmp_path / "pwned"
    (path / METADATA_FILE).write_bytes(pickle.dumps(CreatesFileWhenUnpickled(sentinel)))
    with pytest.raises(CorruptCheckpointError, match=METADATA_FILE):
        load_checkpoint(path)
    assert verify(path)
    assert not sentinel.exists()


def test_a_shard_file_replaced_by_a_pickle_is_refused_without_unpickling(tmp_path):
    path = save(tmp_path / "c", 1, {"weight": torch.randn(64, 64)})
    sentinel = tmp_path / "pwned"
    data_files(path)[-1].write_bytes(pickle.dumps(CreatesFileWhenUnpickled(sentinel)))
    with pytest.raises(CorruptCheckpointError, match="weight"):
        load_checkpoint(path)
    assert not sentinel.exists()


def test_a_planted_torchsnapshot_object_entry_is_refused_without_unpickling(tmp_path):
    path = save(tmp_path / "c", 1)
    sentinel = tmp_path / "pwned"
    (path / "0" / "evil").parent.mkdir(exist_ok=True)
    (path / "0" / "evil").write_bytes(pickle.dumps(CreatesFileWhenUnpickled(sentinel)))
    manifest = yaml.safe_load((path / ".snapshot_metadata").read_text())
    manifest["manifest"]["0/shards/evil"] = {
        "type": "object",
        "location": "0/evil",
        "serializer": "torch_save",
        "obj_type": "builtins.object",
        "replicated": False,
    }
    (path / ".snapshot_metadata").write_text(json.dumps(manifest))
    with pytest.raises(UnsafeCheckpointError, match="0/shards/evil"):
        load_checkpoint(path)
    assert any("pickled" in p for p in verify(path))
    assert not sentinel.exists()


def test_cleanup_removes_uncommitted_directories_except_those_kept(tmp_path):
    save(tmp_path / "done", 1)
    uncommitted(tmp_path / "crashed", 2)
    uncommitted(tmp_path / "in-flight", 3)
    repoint_last(tmp_path, tmp_path / "done")
    removed = cleanup_uncommitted(tmp_path, keep=[tmp_path / "in-flight"])
    assert removed == [tmp_path / "crashed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "in-flight", "last"]


def test_repoint_last_is_atomic_so_the_link_always_resolves_to_a_committed_checkpoint(tmp_path):
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
