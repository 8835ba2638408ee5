"""A training loader that saves its own position (litData's ``StreamingDataLoader``, torchdata's
``StatefulDataLoader``) resumes through Lightning's loop state under ElasticFT3D: exactly, into the next epoch too."""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset

from tests.strategy.models import TinyRegressor, make_trainer

SAMPLES, BATCH = 32, 4  # 8 batches an epoch on one rank


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        self.start = 0

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self):
        for i in range(self.start, len(self.x)):
            yield self.x[i], self.y[i], i


class ReplayingStreamLoader(DataLoader):
    """Behaves as litData's ``StreamingDataLoader`` does: a loaded state holds until an iteration over the loader
    ends (the loop after the last batch runs); until then every ``iter()`` starts from the restored position."""

    def __init__(self) -> None:
        super().__init__(_Stream(SAMPLES), batch_size=BATCH)
        self.yielded = 0
        self.restored: int | None = None

    def __iter__(self):
        self.dataset.start = self.yielded = self.restored or 0
        for batch in super().__iter__():
            self.yielded += len(batch[2])
            yield batch
        self.restored = None

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state["yielded"]


class _Recording(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.ids[self.global_step + 1] = ids.tolist()
        return super().training_step((x, y), batch_idx)

    def train_dataloader(self) -> DataLoader:
        return ReplayingStreamLoader()


def _fit(root, *, ckpt_path: str | None = None) -> _Recording:
    model = _Recording()
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=3, save_top_k=-1)
    make_trainer(root, callbacks=[ckpt], max_steps=12).fit(model, ckpt_path=ckpt_path)
    return model


def test_a_self_stateful_loader_resumed_mid_epoch_goes_on_into_the_next_epoch_as_uninterrupted(tmp_path, caplog):
    straight = _fit(tmp_path / "straight")
    with caplog.at_level(logging.INFO):
        resumed = _fit(tmp_path / "resumed", ckpt_path=str(tmp_path / "straight" / "ckpt" / "epoch=0-step=6.ckpt"))
    # Steps 7 and 8 end epoch 0 from the restored position; 9 to 12 are epoch 1 from its start, not a replay.
    assert resumed.ids == {step: straight.ids[step] for step in range(7, 13)}
    assert resumed.ids[9] == list(range(BATCH))
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "not exact" in m or "not resumable" in m], messages
