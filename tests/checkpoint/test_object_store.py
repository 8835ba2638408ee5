"""Object storage: commit by writing the marker object last, `last` by listing markers, no rename or link anywhere."""

from __future__ import annotations

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from lightning_ft.checkpoint import COMMIT_MARKER
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
    entries = {"t0": torch.arange(8, dtype=torch.uint8), "t1": torch.full((3,), step, dtype=torch.uint8)}
    store.write(url, entries, group=None)
    if commit:
        store.commit(url, {"format_version": 1, "metadata": {"step": step}}, step=step)


def test_entries_read_back_by_rank_and_name_with_ranged_reads(bucket):
    store = ObjectStore()
    _checkpoint(store, "fakeobj://bucket/ckpt/step=1", 1)
    out = torch.empty(3, dtype=torch.uint8)
    reader = store.reader("fakeobj://bucket/ckpt/step=1")
    reader.read(0, "t1", out)
    assert out.tolist() == [1, 1, 1]
    assert reader.files(0, "t0") == ["data/0"] and reader.files(0, "nope") == [] and reader.unsafe_entries() == []
    with pytest.raises(KeyError):
        reader.read(0, "nope", out)


def test_the_marker_is_the_last_object_written_and_last_is_found_by_listing_markers(bucket):
    store = ObjectStore()
    for step in (2, 4, 3):
        _checkpoint(store, f"fakeobj://bucket/ckpt/step={step}", step)
    _checkpoint(store, "fakeobj://bucket/ckpt/step=9", 9, commit=False)  # a save that never committed
    puts = [path for op, path in bucket.calls if op == "put" and "step=4" in path]
    assert puts[-1].endswith(COMMIT_MARKER)
    committed = store.list_committed("fakeobj://bucket/ckpt")
    assert [c.step for c in committed] == [2, 3, 4]
    assert committed[-1].path.endswith("bucket/ckpt/step=4")
    assert store.read_document(committed[-1].path)["metadata"] == {"step": 4}


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
    assert not store.is_committed("fakeobj://bucket/ckpt/step=2")
    removed = store.cleanup_uncommitted("fakeobj://bucket/ckpt", keep=["fakeobj://bucket/ckpt/step=5"])
    assert [r.rsplit("/", 1)[-1] for r in removed] == ["step=3"]
    assert bucket.exists("bucket/ckpt/notes/readme.txt") and bucket.exists("bucket/ckpt/step=5/data/0")
    assert store.list_committed("fakeobj://bucket/ckpt") == []


def test_memory_urls_as_lightning_model_checkpoint_accepts_them(bucket):
    store = ObjectStore()
    _checkpoint(store, "memory://ckpts/step=1", 1)
    assert [c.step for c in store.list_committed("memory://ckpts")] == [1]
    out = torch.empty(8, dtype=torch.uint8)
    store.reader(store.list_committed("memory://ckpts")[0].path).read(0, "t0", out)
    assert out.tolist() == list(range(8))
