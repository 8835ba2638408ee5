"""ModelCheckpoint(dirpath="s3://..." / "gs://..." / "memory://...") under ElasticFT3D: saved, committed and resumed
through object storage, without rename or link. fsspec's in-memory filesystem is the local fake bucket."""

from __future__ import annotations

import errno

import fsspec
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import ElasticFT3D
from lightning_ft.checkpoint import list_committed, load_checkpoint
from lightning_ft.checkpoint.internal import COMMIT_MARKER, FORMATS
from lightning_ft.checkpoint.storage import ObjectStore
from lightning_ft.events import read_events
from lightning_ft.strategy.checkpoint_io import check_checkpoint_callback, check_checkpoint_dirpath
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

pytestmark = pytest.mark.usefixtures("event_log_on_disk")  # these runs read their event log


@pytest.fixture
def bucket(tmp_path):
    """A fresh prefix of the in-memory filesystem (one per test), emptied afterwards."""
    url = f"memory://{tmp_path.name}/ckpt"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{tmp_path.name}"):
        fs.rm(f"/{tmp_path.name}", recursive=True)


def _objects(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    return sorted(p.removeprefix(root + "/") for p in fs.find(root))


def _fit(root, url, max_steps, *, ckpt_path=None, strategy=None, **ckpt_options):
    as_a_new_process()  # each call stands for a launch
    options = {"every_n_train_steps": 2, "save_top_k": -1, **ckpt_options}
    ckpt = ModelCheckpoint(dirpath=url, **options)
    trainer = make_trainer(root, strategy=strategy or ElasticFT3D(), callbacks=[ckpt], max_steps=max_steps)
    model = TinyRegressor()
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize("checkpoint_format", FORMATS)
def test_a_memory_dirpath_commits_by_marker_objects_and_auto_resumes_from_the_newest(
    tmp_path, bucket, checkpoint_format
):
    _, model = _fit(tmp_path, bucket, 4, strategy=ElasticFT3D(checkpoint_format=checkpoint_format), save_last=True)
    committed = list_committed(bucket)
    assert [c.step for c in committed] == [2, 4]  # `last` of step 4 is the step-4 checkpoint: no second copy
    objects = _objects(bucket)
    assert f"epoch=0-step=4.ckpt/{COMMIT_MARKER}" in objects and not any("last" in o for o in objects)
    assert not any(o.endswith(".in_progress") for o in objects)
    loaded = load_checkpoint(committed[-1].path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state["state_dict"][name], tensor), name
    events = read_events(tmp_path)
    assert [e["path"] for e in events if e["event"] == "checkpoint_committed"] == [
        f"{bucket}/epoch=0-step=2.ckpt",
        f"{bucket}/epoch=0-step=4.ckpt",
    ]
    trainer, _ = _fit(tmp_path, bucket, 6)
    assert trainer.global_step == 6
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [4]
    assert [c.step for c in list_committed(bucket)] == [2, 4, 6]


def test_ckpt_path_last_is_the_newest_marker_found_by_listing(tmp_path, bucket):
    _fit(tmp_path, bucket, 4, save_last=True)
    trainer, _ = _fit(tmp_path, bucket, 6, ckpt_path="last", strategy=ElasticFT3D(auto_resume=False))
    assert trainer.global_step == 6
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [4]


def test_retention_deletes_the_worse_checkpoints_of_the_top_k(tmp_path, bucket):
    _fit(tmp_path, bucket, 8, save_top_k=2, monitor="step", mode="max")
    assert [c.step for c in list_committed(bucket)] == [6, 8]
    assert {o.split("/", 1)[0] for o in _objects(bucket)} == {"epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"}


def test_a_save_that_fails_leaves_no_marker_and_no_objects_and_the_run_raises_its_error(tmp_path, bucket, monkeypatch):
    real_write = ObjectStore.write
    calls = {"n": 0}

    def write_until_the_bucket_refuses(self, path, entries, *, group):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, path, entries, group=group)

    monkeypatch.setattr(ObjectStore, "write", write_until_the_bucket_refuses)
    with pytest.raises(OSError) as raised:
        _fit(tmp_path, bucket, 8)
    assert raised.value.errno == errno.ENOSPC
    assert [c.step for c in list_committed(bucket)] == [2]
    assert {o.split("/", 1)[0] for o in _objects(bucket)} == {"epoch=0-step=2.ckpt"}  # the failed save's are gone


def test_a_url_whose_filesystem_is_not_installed_or_cannot_commit_is_refused_naming_the_option(tmp_path):
    if "s3" not in fsspec.registry:
        try:
            fsspec.get_filesystem_class("s3")
        except ImportError:
            with pytest.raises(ValueError, match=r"ModelCheckpoint\(dirpath='s3://bucket/ckpt'\): s3:// needs a pack"):
                check_checkpoint_dirpath("s3://bucket/ckpt")
    with pytest.raises(ValueError, match=r"dirpath='https://example.com/ckpt'\): https:// is not a storage"):
        check_checkpoint_dirpath("https://example.com/ckpt")
    with pytest.raises(ValueError, match=r"fsspec knows no filesystem for nosuchfs://"):
        check_checkpoint_dirpath("nosuchfs://bucket/ckpt")
    check_checkpoint_dirpath(f"memory://{tmp_path.name}/ok")
    check_checkpoint_dirpath(f"file://{tmp_path}")


def test_the_fault_injectors_storage_errors_reach_object_store_saves_in_either_format(tmp_path, bucket):
    from lightning_ft.fault import FaultInjector

    injector = FaultInjector().storage_error_at(rank=0, step=4, errno="ENOSPC")
    ckpt = ModelCheckpoint(dirpath=bucket, every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        tmp_path, strategy=ElasticFT3D(checkpoint_format="dcp"), callbacks=[ckpt, injector], max_steps=8
    )
    with pytest.raises(OSError) as raised:
        trainer.fit(TinyRegressor())
    assert raised.value.errno == errno.ENOSPC and "injected by FaultInjector" in str(raised.value)
    assert [c.step for c in list_committed(bucket)] == [2]
    assert {o.split("/", 1)[0] for o in _objects(bucket)} == {"epoch=0-step=2.ckpt"}


def test_options_that_cannot_work_with_object_storage_are_refused_before_training(tmp_path, bucket):
    ckpt = ModelCheckpoint(dirpath=bucket, every_n_train_steps=2, save_last="link")
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=4)
    with pytest.raises(ValueError, match=r"save_last='link'\): an object store has no links"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0 and list_committed(bucket) == []
    with pytest.raises(ValueError, match=r"memory:// is private to each process, so 2 processes cannot share"):
        check_checkpoint_callback(ModelCheckpoint(dirpath=bucket), world_size=2)
    check_checkpoint_callback(ModelCheckpoint(dirpath=bucket), world_size=1)


def test_validate_with_best_in_a_fresh_trainer_reads_the_callback_state_from_the_bucket(tmp_path, bucket):
    from tests.strategy.test_eval_and_top_k import ScoredRegressor

    def callback():
        return ModelCheckpoint(dirpath=bucket, every_n_train_steps=1, save_top_k=2, monitor="score", mode="min")

    trained = make_trainer(tmp_path, callbacks=[callback()], max_steps=6, limit_val_batches=1)
    trained.fit(ScoredRegressor())
    assert trained.checkpoint_callback.best_model_path.endswith("step=4.ckpt")
    best = load_checkpoint(f"{bucket}/epoch=0-step=4.ckpt").state["state_dict"]
    trainer = make_trainer(tmp_path, callbacks=[callback()], limit_val_batches=1)  # knows nothing of the run
    model = ScoredRegressor()
    trainer.validate(model, ckpt_path="best")
    for name, tensor in best.items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_train_start_deletes_saves_of_ours_that_never_committed_and_nothing_else(tmp_path, bucket):
    store = ObjectStore()
    crashed = store.prepare(f"{bucket}/epoch=0-step=9.ckpt", step=9, run_id=None)  # a save killed mid-write
    store.write(crashed, {"t0": torch.arange(8, dtype=torch.uint8)}, group=None)
    fs, root = fsspec.core.url_to_fs(bucket)
    fs.pipe_file(f"{root}/notes/readme.txt", b"a user's file")
    _fit(tmp_path, bucket, 2)
    assert not store.exists(f"{bucket}/epoch=0-step=9.ckpt")
    assert fs.cat_file(f"{root}/notes/readme.txt") == b"a user's file"
    assert [c.step for c in list_committed(bucket)] == [2]


def test_a_url_default_root_dir_keeps_the_event_log_in_the_working_directory(tmp_path, bucket, monkeypatch, caplog):
    # Lightning accepts an object-store default_root_dir (its own checkpoints go there); an event log cannot be
    # appended to there, and the URL taken as a local path would make a folder named "memory:".
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer(bucket, max_steps=2, callbacks=[ModelCheckpoint(every_n_train_steps=2)])
    trainer.fit(TinyRegressor())
    assert not (tmp_path / "memory:").exists()
    assert [e["event"] for e in read_events(tmp_path)][:1] == ["attempt_start"]
    assert "is not a local folder; the event log is written under" in caplog.text
    # The checkpoint still goes where Lightning puts it: the default dirpath under the URL.
    assert "checkpoints/epoch=0-step=2.ckpt/lightning_ft.committed" in _objects(bucket)
