"""A strategy object serves one Trainer, as Lightning's own do: a second Trainer (a library's predict after its fit)
gets a new ``ElasticFT3D()``, and that works in the same process; the used object is refused by Lightning."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_ft import ElasticFT3D
from tests.strategy.models import RandomVectors, TinyRegressor, make_trainer


class _Predicting(TinyRegressor):
    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def _second_trainer(root, strategy) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, default_root_dir=root, logger=False, enable_progress_bar=False
    )


def test_a_fit_then_a_predict_by_a_second_trainer_with_a_new_strategy_works(tmp_path):
    model = _Predicting()
    make_trainer(tmp_path, max_steps=2).fit(model)
    out = _second_trainer(tmp_path, ElasticFT3D()).predict(model, DataLoader(RandomVectors(8), batch_size=4))
    assert [tuple(o.shape) for o in out] == [(4, 1), (4, 1)]


def test_a_strategy_object_that_served_a_trainer_is_refused_by_the_next(tmp_path):
    strategy = ElasticFT3D()
    make_trainer(tmp_path, strategy=strategy, max_steps=2).fit(_Predicting())
    with pytest.raises(MisconfigurationException, match="set through both strategy class and accelerator flag"):
        _second_trainer(tmp_path, strategy)
