"""What ElasticFT3D never deletes (files it did not write, a save in flight), and resuming after a crash mid-replacement."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_ft.checkpoint import AsyncCheckpointer, list_committed
from lightning_ft.checkpoint.internal import discovery as discovery_module
from lightning_ft.checkpoint.internal import is_committed, read_metadata
from lightning_ft.events import read_events
from lightning_ft.strategy.auto_resume import resume_candidates
from tests.checkpoint.support import checkpoint_format, folders_only, format_storage_class
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

# Each test runs against every format; these runs read their event log, as a restarted run keeps it on disk.
pytestmark = pytest.mark.usefixtures("checkpoint_format", "event_log_on_disk")

USER_FILES = {
    "src/model.py": b"class Model: ...\n",
    "data/train.bin": b"\x00\x01\x02",
    ".git/HEAD": b"ref: refs/heads/main\n",
    "dcp-checkpoint/.metadata": b"a DCP checkpoint of another tool",
    "dcp-checkpoint/__0_0.distcp": b"shard",
    "notes.txt": b"mine",
}


def _write_user_files(root):
    for name, data in USER_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def _assert_user_files_intact(root):
    for name, data in USER_FILES.items():
        assert (root / name).read_bytes() == data, f"{name} was deleted or changed"


def _fit(root, max_steps, dirpath, **kwargs):
    as_a_new_process()  # each call stands for a launch
    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, **kwargs)
    trainer = make_trainer(root, callbacks=[ckpt], max_steps=max_steps)
    trainer.fit(TinyRegressor())
    return trainer


def test_a_dirpath_of_dot_keeps_the_users_files_another_tools_checkpoint_and_the_event_log(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_user_files(tmp_path)
    _fit(tmp_path, 2, ".")
    trainer = _fit(tmp_path, 4, ".")  # the second launch cleans up at train start
    assert trainer.global_step == 4
    _assert_user_files_intact(tmp_path)
    events = read_events(tmp_path)
    assert [e["attempt"] for e in events if e["event"] == "attempt_start"] == [0, 1]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [2]
    assert [c.step for c in list_committed(tmp_path)] == [2, 4]


def test_a_dirpath_equal_to_default_root_dir_trains_and_resumes(tmp_path):
    _fit(tmp_path, 2, tmp_path)
    trainer = _fit(tmp_path, 4, tmp_path)
    assert trainer.global_step == 4
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [2]
    assert (tmp_path / "lightning-ft" / "events").is_dir()


class _SaveAtTrainStart(Callback):
    """Saves from ``on_train_start``; the write is held until the first batch, after the strategy's cleanup ran."""

    def __init__(self, path, started: threading.Event, gate: threading.Event) -> None:
        self.path = path
        self.started = started
        self.gate = gate
        self.existed_after_cleanup: bool | None = None

    def on_train_start(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)
        assert self.started.wait(timeout=120)  # its folder exists and data is being written

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.existed_after_cleanup is None:
            staged = list(self.path.parent.glob(f".{self.path.name}.lft-new-*"))  # where a checkpoint file is written
            self.existed_after_cleanup = self.path.is_dir() or bool(staged)
            self.gate.set()


def test_a_save_issued_from_an_on_train_start_hook_survives_the_cleanup_at_train_start(tmp_path, monkeypatch):
    dirpath = tmp_path / "ckpt"
    path = dirpath / "at-train-start.ckpt"
    started, gate = threading.Event(), threading.Event()
    storage_class = format_storage_class()
    real_write = storage_class.write

    def held_write(self, folder, entries, *, group, **kwargs):
        if folder == path or Path(folder).name.startswith(f".{path.name}.lft-new-"):  # a file is written beside
            started.set()
            assert gate.wait(timeout=120)
        return real_write(self, folder, entries, group=group, **kwargs)

    monkeypatch.setattr(storage_class, "write", held_write)
    hook = _SaveAtTrainStart(path, started, gate)
    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, callbacks=[hook, ckpt], max_steps=2)
    try:
        trainer.fit(TinyRegressor())
    finally:
        started.set()
        gate.set()
    assert hook.existed_after_cleanup is True
    assert is_committed(path) and read_metadata(path)["step"] == 0


def test_a_launch_after_a_crash_mid_replacement_resumes_from_the_newest_committed_state(tmp_path):
    folders_only("it stages the two folders of a replacement by hand")
    dirpath = tmp_path / "ckpt"
    state = dirpath / "state.ckpt"  # no {step} in the filename: every save replaces the one before
    _fit(tmp_path, 2, dirpath, filename="state")
    shutil.copytree(state, tmp_path / "state-at-step-2")
    _fit(tmp_path, 4, dirpath, filename="state")
    assert read_metadata(state)["step"] == 4
    assert sorted(p.name for p in dirpath.iterdir()) == ["state.ckpt"]

    # The process died between the two renames of a replacement: the old one moved aside, the new one not yet in.
    os.rename(state, dirpath / ".state.ckpt.lft-new-0123456789abcdef")
    shutil.copytree(tmp_path / "state-at-step-2", dirpath / ".state.ckpt.lft-old-0123456789abcdef")
    trainer = _fit(tmp_path, 6, dirpath, filename="state")

    assert trainer.global_step == 6
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [2, 4]
    assert sorted(p.name for p in dirpath.iterdir()) == ["state.ckpt"]
    assert read_metadata(state)["step"] == 6


def test_resume_candidates_take_full_state_from_the_markers_and_sort_a_checkpoint_without_a_step_last(
    tmp_path, monkeypatch
):
    for name, metadata in {
        "weights-only": {"step": 5, "full_state": False},
        "full": {"step": 4, "full_state": True},
        "no-step": {"full_state": True},
        "older-release": {"step": 3},  # a marker without full_state: its metadata is read
    }.items():
        writer = AsyncCheckpointer()
        writer.save(tmp_path / name, {"w": torch.ones(2)}, metadata=metadata)
        writer.close()
    read = []
    real_read_metadata = discovery_module.read_metadata

    def recording_read_metadata(path):
        read.append(path.name)
        return real_read_metadata(path)

    monkeypatch.setattr(discovery_module, "read_metadata", recording_read_metadata)
    assert [c.path.name for c in resume_candidates([tmp_path])] == ["full", "older-release", "no-step"]
    assert read == ["older-release"]
    if checkpoint_format() != "file":  # a file's marker is inside it
        assert json.loads((tmp_path / "full" / "lightning_ft.committed").read_text())["full_state"] is True
