"""A full disk during a background save stops training with that error; the last committed checkpoint survives."""

from __future__ import annotations

import errno

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft.checkpoint import list_committed, load_checkpoint
from lightning_ft.checkpoint.internal import is_committed
from tests.checkpoint.support import format_storage_class
from tests.strategy.models import TinyRegressor, make_trainer

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


def test_a_full_disk_fails_the_run_at_the_next_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    storage_class = format_storage_class()
    real_write = storage_class.write
    calls = {"n": 0}

    def write_until_the_disk_fills(self, path, entries, *, group, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:  # the first checkpoint fits, the second does not
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, path, entries, group=group, **kwargs)

    monkeypatch.setattr(storage_class, "write", write_until_the_disk_fills)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=8)
    with pytest.raises(OSError) as raised:
        trainer.fit(TinyRegressor())
    assert raised.value.errno == errno.ENOSPC
    # The save at step 4 failed in the background; the next save call (step 6) raised it.
    assert trainer.global_step == 6
    committed = list_committed(tmp_path / "ckpt")
    assert [c.step for c in committed] == [2]
    assert not is_committed(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    loaded = load_checkpoint(committed[0].path)
    assert loaded.metadata["step"] == 2
