"""Object storage: commit by writing the marker object last, `last` by listing markers, no rename or link anywhere.

The fake bucket refuses rename, copy and link, as S3, GCS and Azure do not have them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from lightning_ft.checkpoint import CheckpointError, CheckpointNotFoundError, UncommittedCheckpointError
from lightning_ft.checkpoint.internal import COMMIT_MARKER, as_url, is_remote
from lightning_ft.checkpoint.storage import ObjectStore


class FakeObjectStore(MemoryFileSystem):
    """An in-memory bucket with an object store's limits: no rename, copy or link; every call is recorded."""

    protocol = "fakeobj"
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path):
        return str(path).removeprefix("fakeobj://").rstrip("/")

    calls: list[tuple[str, str]] = []  # noqa: RUF012 - shared by every instance, like the bucket itself

    def pipe_file(self, path, value, **kwargs):
        self.calls.append(("put", path))
        return super().pipe_file(path, value, **kwargs)

    def rm_file(self, path):
        self.calls.append(("delete", path))
        return super().rm_file(path)

    def _refused(self, *args, **kwargs):
        raise NotImplementedError("object stores have no rename, copy or link")

    mv = rename = copy = cp_file = link = symlink = _refused


@pytest.fixture
def bucket():
    import fsspec

    fsspec.register_implementation("fakeobj", FakeObjectStore, clobber=True)
    fs = fsspec.filesystem("fakeobj")
    FakeObjectStore.store.clear()
    FakeObjectStore.pseudo_dirs.clear()
    fs.calls.clear()
    yield fs
    FakeObjectStore.store.clear()


def _checkpoint(store, url, step, *, commit=True):
    folder = store.prepare(url, step=step, run_id=None)
    entries = {"t0": torch.arange(8, dtype=torch.uint8), "t1": torch.full((3,), step, dtype=torch.uint8)}
    store.write(folder, entries, group=None)
    if commit:
        store.commit(folder, {"format_version": 1, "metadata": {"step": step}}, step=step).finish()
    return folder


def test_entries_read_back_by_rank_and_name_with_ranged_reads(bucket):
    store = ObjectStore()
    _checkpoint(store, "fakeobj://bucket/ckpt/step=1", 1)
    out = torch.empty(3, dtype=torch.uint8)
    reader = store.reader("fakeobj://bucket/ckpt/step=1")
    reader.read(0, "t1", out)
    assert out.tolist() == [1, 1, 1]
    assert reader.files(0, "t0")[0].endswith("/data/0") and reader.files(0, "nope") == []
    assert reader.unsafe_entries() == []
    with pytest.raises(KeyError):
        reader.read(0, "nope", out)


def test_the_marker_is_the_last_object_written_and_last_is_found_by_listing_markers(bucket):
    store = ObjectStore()
    for step in (2, 4, 3):
        _checkpoint(store, f"fakeobj://bucket/ckpt/step={step}", step)
    _checkpoint(store, "fakeobj://bucket/ckpt/step=9", 9, commit=False)  # a save that never committed
    puts = [path for op, path in bucket.calls if op == "put" and "step=4" in path]
    assert puts[-1].endswith(f"step=4/{COMMIT_MARKER}")
    committed = store.list_committed("fakeobj://bucket/ckpt")
    assert [c.step for c in committed] == [2, 3, 4]
    assert committed[-1].path.endswith("bucket/ckpt/step=4")
    assert store.read_document(committed[-1].path)["metadata"] == {"step": 4}
    with pytest.raises(UncommittedCheckpointError):
        store.read_document("fakeobj://bucket/ckpt/step=9")
    with pytest.raises(CheckpointNotFoundError):
        store.read_document("fakeobj://bucket/ckpt/step=10")


def test_a_replacement_is_one_marker_put_and_the_old_generation_stays_committed_until_then(bucket):
    store = ObjectStore()
    url = "fakeobj://bucket/ckpt/latest"
    _checkpoint(store, url, 1)
    folder = store.prepare(url, step=2, run_id=None)
    store.write(
        folder, {"t0": torch.arange(8, dtype=torch.uint8), "t1": torch.full((3,), 2, dtype=torch.uint8)}, group=None
    )
    assert store.read_document(url)["metadata"] == {"step": 1}  # the new data is written; the old one still counts
    commit = store.commit(folder, {"format_version": 1, "metadata": {"step": 2}}, step=2)
    assert store.read_document(url)["metadata"] == {"step": 2}
    commit.undo()  # a failure after the marker: the old marker comes back, the new generation goes
    assert store.read_document(url)["metadata"] == {"step": 1}
    out = torch.empty(3, dtype=torch.uint8)
    store.reader(url).read(0, "t1", out)
    assert out.tolist() == [1, 1, 1]
    assert len({p.split("/")[3] for p in bucket.find("bucket/ckpt/latest") if "/lft-" in p}) == 1


def test_removal_deletes_the_marker_first_and_cleanup_touches_only_its_own_uncommitted_saves(bucket):
    store = ObjectStore()
    _checkpoint(store, "fakeobj://bucket/ckpt/step=2", 2)
    _checkpoint(store, "fakeobj://bucket/ckpt/step=3", 3, commit=False)
    _checkpoint(store, "fakeobj://bucket/ckpt/step=5", 5, commit=False)  # the save in flight
    bucket.pipe_file("bucket/ckpt/notes/readme.txt", b"a user's file")
    bucket.calls.clear()
    store.remove("fakeobj://bucket/ckpt/step=2")
    deletes = [path for op, path in bucket.calls if op == "delete"]
    assert deletes[0].endswith(f"step=2/{COMMIT_MARKER}")
    assert not store.is_committed("fakeobj://bucket/ckpt/step=2") and not store.exists("fakeobj://bucket/ckpt/step=2")
    removed = store.cleanup_uncommitted("fakeobj://bucket/ckpt", keep=["fakeobj://bucket/ckpt/step=5"])
    assert [r.split("/")[-2] for r in removed] == ["step=3"]
    assert bucket.exists("bucket/ckpt/notes/readme.txt") and store.is_ours("fakeobj://bucket/ckpt/step=5")
    assert store.list_committed("fakeobj://bucket/ckpt") == []
    with pytest.raises(CheckpointError, match="cannot prove it wrote"):
        store.prepare("fakeobj://bucket/ckpt/notes", step=1, run_id=None)


def test_memory_urls_as_lightning_model_checkpoint_accepts_them(bucket):
    store = ObjectStore()
    _checkpoint(store, "memory://ckpts-object-store-test/step=1", 1)
    try:
        [info] = store.list_committed("memory://ckpts-object-store-test")
        out = torch.empty(8, dtype=torch.uint8)
        store.reader(info.path).read(0, "t0", out)
        assert out.tolist() == list(range(8))
    finally:
        store.remove("memory://ckpts-object-store-test/step=1")


def test_urls_survive_pathlib_which_folds_their_double_slash():
    assert as_url(Path("s3://bucket/ckpts/step=1")) == "s3://bucket/ckpts/step=1"
    assert as_url(Path("memory://ckpts")) == "memory://ckpts"
    assert is_remote(Path("gs://b/k")) and is_remote("memory://x")
    assert not is_remote(Path("checkpoints/step=1")) and not is_remote("/abs/path") and not is_remote("file:///x")


def test_the_async_checkpointer_for_urls_saves_replaces_and_undoes_in_a_bucket_without_rename(bucket):
    from lightning_ft.checkpoint import load_checkpoint
    from lightning_ft.checkpoint.internal import ObjectStoreCheckpointer, RoutedStorage, SnapshotStorage

    url = "fakeobj://bucket/ckpt/latest"
    weight = torch.arange(6.0)
    fail = {"on": False}

    def on_commit(info):
        if fail["on"]:
            raise ValueError("event log full")

    writer = ObjectStoreCheckpointer(storage=RoutedStorage(SnapshotStorage()), on_commit=on_commit)
    try:
        writer.save(Path(url), {"w": weight}, metadata={"step": 1})
        weight.add_(100)  # after the capture: never reaches the checkpoint
        writer.save(url, {"w": torch.zeros(6)}, metadata={"step": 2})  # replaces it
        writer.wait()
        fail["on"] = True
        writer.save(url, {"w": torch.ones(6)}, metadata={"step": 3})
        with pytest.raises(ValueError, match="event log full"):
            writer.wait()
    finally:
        writer.close()
    loaded = load_checkpoint(url)
    assert loaded.metadata["step"] == 2 and torch.equal(loaded.state["w"], torch.zeros(6))
    assert len({p.split("/")[3] for p in bucket.find("bucket/ckpt/latest") if "/lft-" in p}) == 1
    assert ObjectStore().cleanup_uncommitted("fakeobj://bucket/ckpt") == []
