"""The memory tier in one process: a crashed ``fit`` resumes from node-local memory bitwise; a damaged, stale or
foreign copy is skipped with an event and the durable tier is used, exactly; a full folder fails the memory save only;
the budget is checked before training; a finished run leaves nothing of its own behind."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_ft import ElasticFT3D, MemoryTier
from lightning_ft.checkpoint.internal import MemoryFileStorage
from lightning_ft.events import read_events
from lightning_ft.strategy import memory_checkpoints
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

MAX_STEPS = 10


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def fit(
    root: Path, *, tier: MemoryTier | None, crash: int | None = None, durable_every: int = 4, accumulate: int = 1
) -> TinyRegressor:
    as_a_new_process()  # each call stands for a launch
    L.seed_everything(0)
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=durable_every, save_top_k=-1)
    ]
    if crash is not None:
        callbacks.append(CrashAt(crash))
    trainer = make_trainer(
        root,
        strategy=ElasticFT3D(memory_tier=tier),
        callbacks=callbacks,
        max_steps=MAX_STEPS,
        accumulate_grad_batches=accumulate,
    )
    model = TinyRegressor()
    if crash is None:
        trainer.fit(model)
    else:
        with pytest.raises(RuntimeError, match="crash at step"):
            trainer.fit(model)
    return model


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def events(root: Path, name: str) -> list[dict]:
    return [e for e in read_events(root) if e["event"] == name]


@pytest.fixture
def shm(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "shm"
    monkeypatch.setenv("LIGHTNING_FT_MEMORY_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> TinyRegressor:
    """An uninterrupted run without the memory tier: what every run below must end at, bitwise. A module fixture
    runs outside the per-test clean-up, so it releases the process group and Lightning's rendezvous variables itself
    (a later test's child process would inherit a MASTER_PORT still held here)."""
    env_before = dict(os.environ)
    model = fit(tmp_path_factory.mktemp("reference"), tier=None)
    if dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(env_before):
        del os.environ[key]
    return model


def own_copies(shm: Path) -> list[Path]:
    return sorted(shm.glob("lightning-ft/*/rank0/step=*"))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every_n_train_steps": 0}, ValueError, r"MemoryTier\(every_n_train_steps=0\): must be >= 1"),
        ({"every_n_train_steps": 2.5}, TypeError, r"MemoryTier\(every_n_train_steps=2.5\): must be an int"),
        ({"every_n_train_steps": True}, TypeError, r"every_n_train_steps=True"),
        ({"dirpath": ""}, ValueError, r"MemoryTier\(dirpath=''\)"),
        ({"dirpath": 3}, TypeError, r"MemoryTier\(dirpath=3\)"),
        ({"peer_copy": "yes"}, TypeError, r"MemoryTier\(peer_copy='yes'\)"),
    ],
)
def test_memory_tier_options_are_checked_naming_the_option_the_value_and_the_rule(kwargs, error, message):
    with pytest.raises(error, match=message):
        MemoryTier(**kwargs)


def test_elasticft3d_refuses_a_memory_tier_that_is_not_a_memory_tier():
    with pytest.raises(TypeError, match=r"ElasticFT3D\(memory_tier=10\): must be a MemoryTier or None"):
        ElasticFT3D(memory_tier=10)


def test_the_memory_folder_comes_from_the_environment_variable_when_set(monkeypatch):
    monkeypatch.setenv("LIGHTNING_FT_MEMORY_DIR", "/tmp/node-a")
    assert MemoryTier().resolved_dirpath() == Path("/tmp/node-a")
    monkeypatch.delenv("LIGHTNING_FT_MEMORY_DIR")
    assert MemoryTier(dirpath="/tmp/node-b").resolved_dirpath() == Path("/tmp/node-b")


def test_a_crashed_fit_resumes_from_its_memory_copy_bitwise_and_a_finished_one_leaves_none(tmp_path, shm, reference):
    fit(tmp_path, tier=MemoryTier(every_n_train_steps=2), crash=7)
    assert [p.name for p in own_copies(shm)] == ["step=6"]  # only the newest committed step is kept
    resumed = fit(tmp_path, tier=MemoryTier(every_n_train_steps=2))
    assert_same_weights(resumed, reference)
    (event,) = events(tmp_path, "resumed")
    assert event["step"] == 6  # the durable tier has only step 4
    assert event["tier"] == "local" and event["restored_from"] == {"local": 1, "peer": 0, "durable": 0}
    committed = events(tmp_path, "checkpoint_committed")
    assert {e["tier"] for e in committed} == {"memory", "durable"}
    assert [e["step"] for e in committed if e["tier"] == "memory"] == [2, 4, 6, 8, 10]
    assert not (shm / "lightning-ft").exists()  # the finished run removed its own folder


def test_with_gradient_accumulation_a_memory_resume_is_bitwise_and_saves_each_step_once(tmp_path, shm):
    reference = fit(tmp_path / "reference", tier=None, accumulate=2)
    fit(tmp_path / "run", tier=MemoryTier(every_n_train_steps=3), crash=7, accumulate=2)
    resumed = fit(tmp_path / "run", tier=MemoryTier(every_n_train_steps=3), accumulate=2)
    assert_same_weights(resumed, reference)
    (event,) = events(tmp_path / "run", "resumed")
    assert event["tier"] == "local" and event["step"] == 6
    memory = [e["step"] for e in events(tmp_path / "run", "checkpoint_committed") if e["tier"] == "memory"]
    assert memory == [3, 6, 9]


def _flip_a_byte(copy: Path) -> None:
    shard = max((copy / "shards").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _truncate(copy: Path) -> None:
    shard = max((copy / "shards").iterdir(), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-8])


def _mislabel_step(copy: Path) -> None:
    copy.rename(copy.with_name("step=8"))  # a copy that claims a newer step than it holds


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate, _mislabel_step], ids=["flipped", "truncated", "stale"])
def test_a_damaged_memory_copy_is_skipped_with_an_event_and_the_durable_tier_restores_exactly(
    tmp_path, shm, reference, damage
):
    fit(tmp_path, tier=MemoryTier(every_n_train_steps=2), crash=7)
    (copy,) = own_copies(shm)
    damage(copy)
    resumed = fit(tmp_path, tier=MemoryTier(every_n_train_steps=2))
    assert_same_weights(resumed, reference)
    (rejected,) = events(tmp_path, "checkpoint_rejected")
    assert rejected["tier"] == "local" and "shm" in rejected["path"]
    (event,) = events(tmp_path, "resumed")
    assert event["tier"] == "durable" and event["step"] == 4
    assert event["restored_from"] == {"local": 0, "peer": 0, "durable": 1}


def test_a_memory_copy_older_than_the_durable_checkpoint_is_not_used(tmp_path, shm, reference):
    fit(tmp_path, tier=MemoryTier(every_n_train_steps=4), crash=7, durable_every=2)  # memory 4, durable 6
    resumed = fit(tmp_path, tier=MemoryTier(every_n_train_steps=4), durable_every=2)
    assert_same_weights(resumed, reference)
    (event,) = events(tmp_path, "resumed")
    assert event["tier"] == "durable" and event["step"] == 6


def test_another_run_s_memory_files_are_skipped_and_never_deleted(tmp_path, shm, reference):
    fit(tmp_path, tier=MemoryTier(every_n_train_steps=2), crash=7)
    (copy,) = own_copies(shm)
    run_dir = copy.parents[1]
    # Another run's folder beside ours, and another run's copy (newer) dropped into our own folder.
    other = shm / "lightning-ft" / "another-run" / "rank0" / "step=6"
    shutil.copytree(copy, other)
    (other.parent / "notes.txt").write_text("not ours")
    foreign = run_dir / "rank0" / "step=8"
    shutil.copytree(copy, foreign)
    meta = foreign / "lightning_ft_metadata.json"
    run_id = run_dir.name.rsplit("-", 1)[0]  # the folder is <run id>-<key of the checkpoint folders and model>
    meta.write_text(meta.read_text().replace(run_id, "another-run"))
    marker = foreign / "lightning_ft.committed"
    import json  # noqa: E401, PLC0415 - the marker's metadata checksum follows the edit
    import zlib

    record = json.loads(marker.read_text())
    record.update(step=8, metadata_crc32=zlib.crc32(meta.read_bytes()))
    marker.write_text(json.dumps(record))
    meta.write_text(meta.read_text().replace('"step": 6', '"step": 8'))
    record.update(metadata_crc32=zlib.crc32(meta.read_bytes()))
    marker.write_text(json.dumps(record))

    resumed = fit(tmp_path, tier=MemoryTier(every_n_train_steps=2))
    assert_same_weights(resumed, reference)
    (rejected,) = events(tmp_path, "checkpoint_rejected")
    assert rejected["tier"] == "local" and "run_id" in rejected["reason"] and rejected["step"] == 8
    (event,) = events(tmp_path, "resumed")
    assert event["tier"] == "local" and event["step"] == 6
    assert (other / "lightning_ft.committed").is_file() and (other.parent / "notes.txt").is_file()
    assert sorted(p.name for p in (shm / "lightning-ft").iterdir()) == ["another-run"]


def test_a_full_memory_folder_fails_the_memory_save_only_and_training_computes_the_same(
    tmp_path, shm, reference, monkeypatch
):
    # No tiny tmpfs here: the storage seam of the memory tier raises ENOSPC from the second save on, as a full
    # /dev/shm does.
    real_write = MemoryFileStorage.write
    calls = {"n": 0}

    def write_until_full(self, path, entries, *, group=None):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(self, path, entries, group=group)

    monkeypatch.setattr(MemoryFileStorage, "write", write_until_full)
    model = fit(tmp_path, tier=MemoryTier(every_n_train_steps=2))
    assert_same_weights(model, reference)
    failed = events(tmp_path, "checkpoint_failed")
    assert [e["step"] for e in failed] == [4, 6, 8, 10]
    assert all(e["tier"] == "memory" and "No space left" in e["reason"] for e in failed)
    assert [e["step"] for e in events(tmp_path, "checkpoint_committed") if e["tier"] == "durable"] == [4, 8]


def test_a_memory_tier_that_does_not_fit_the_folder_stops_fit_before_the_first_step(tmp_path, shm, monkeypatch):
    monkeypatch.setattr(memory_checkpoints, "free_bytes", lambda path: 100)
    L.seed_everything(0)
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(memory_tier=MemoryTier()), max_steps=4)
    with pytest.raises(ValueError, match=r"ElasticFT3D\(memory_tier=MemoryTier\(dirpath=.*MiB per node.*0.0 MiB free"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0


def test_the_budget_counts_own_and_peer_copies_with_the_one_being_written():
    two_nodes = memory_checkpoints.NodeLayout(rank=0, world_size=4, local_rank=0, local_world_size=2)
    assert memory_checkpoints.memory_budget(100, layout=two_nodes, peer_copy=True) == (400, 800)
    assert memory_checkpoints.memory_budget(100, layout=two_nodes, peer_copy=False) == (200, 400)
    one_node = memory_checkpoints.NodeLayout(rank=0, world_size=2, local_rank=0, local_world_size=2)
    assert memory_checkpoints.memory_budget(100, layout=one_node, peer_copy=True) == (200, 400)


def test_partners_are_the_same_local_rank_on_the_next_node():
    layouts = [
        memory_checkpoints.NodeLayout(rank=r, world_size=6, local_rank=r % 2, local_world_size=2) for r in range(6)
    ]
    assert [layout.partner for layout in layouts] == [2, 3, 4, 5, 0, 1]
    assert [layout.source for layout in layouts] == [4, 5, 0, 1, 2, 3]
    assert all(layouts[layout.partner].source == layout.rank for layout in layouts)


def test_a_memory_tier_larger_than_the_node_s_available_memory_stops_fit_before_the_first_step(
    tmp_path, shm, monkeypatch
):
    monkeypatch.setattr(memory_checkpoints, "mem_available_bytes", lambda: 1000)
    L.seed_everything(0)
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(memory_tier=MemoryTier()), max_steps=4)
    with pytest.raises(ValueError, match=r"MemoryTier\(dirpath=.*staging copies.*MiB MemAvailable"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0


def test_a_memory_folder_that_cannot_be_written_stops_fit_before_the_first_step(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the memory folder should be")
    monkeypatch.setenv("LIGHTNING_FT_MEMORY_DIR", str(blocker))
    L.seed_everything(0)
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(memory_tier=MemoryTier()), max_steps=4)
    with pytest.raises(ValueError, match=r"MemoryTier\(dirpath=.*cannot write into"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0
