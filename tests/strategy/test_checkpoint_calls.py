"""``ElasticFT3D.load_checkpoint``: the path is classified once, at the entry, and every reader takes that value."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft.checkpoint import location
from lightning_ft.strategy import auto_resume
from tests.strategy.models import TinyRegressor, make_trainer


@pytest.fixture
def counted(monkeypatch):
    """Counts every classification of a path: :func:`locate` and the look at a folder's files behind it."""
    calls = {"locate": 0, "is_lightning_ft_checkpoint": 0}
    locate, is_ours = location.locate, location.is_lightning_ft_checkpoint

    def counting_locate(path):
        calls["locate"] += 1
        return locate(path)

    def counting_is_ours(path):
        calls["is_lightning_ft_checkpoint"] += 1
        return is_ours(path)

    monkeypatch.setattr(auto_resume, "locate", counting_locate)
    monkeypatch.setattr(location, "is_lightning_ft_checkpoint", counting_is_ours)
    return calls


def _first_run(tmp_path):
    trainer = make_trainer(
        tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)], max_steps=4
    )
    trainer.fit(TinyRegressor(), ckpt_path=None)
    return tmp_path / "ckpt"


@pytest.mark.parametrize("how", ["folder", "last link"])
def test_a_resume_from_an_explicit_ckpt_path_classifies_it_once(tmp_path, counted, how):
    folder = _first_run(tmp_path / "run")
    [checkpoint] = [p for p in folder.iterdir() if p.name.endswith(".ckpt")]
    path = checkpoint
    if how == "last link":
        path = folder / "last.ckpt"
        os.symlink(checkpoint.name, path)
    counted.update(locate=0, is_lightning_ft_checkpoint=0)
    trainer = make_trainer(tmp_path / "run", callbacks=[ModelCheckpoint(dirpath=folder)], max_steps=6)
    trainer.fit(TinyRegressor(), ckpt_path=str(path))
    assert trainer.global_step == 6
    assert counted == {"locate": 1, "is_lightning_ft_checkpoint": 1 if how == "folder" else 0}


def test_auto_resume_classifies_its_candidates_from_the_listing_alone(tmp_path, counted):
    folder = _first_run(tmp_path / "run")
    counted.update(locate=0, is_lightning_ft_checkpoint=0)
    trainer = make_trainer(tmp_path / "run", callbacks=[ModelCheckpoint(dirpath=folder)], max_steps=6)
    trainer.fit(TinyRegressor())
    assert trainer.global_step == 6
    assert counted == {"locate": 0, "is_lightning_ft_checkpoint": 0}
