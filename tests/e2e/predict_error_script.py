"""One rank's error in ``predict`` after a ``fit``, as a library's predict raises on one rank (darts' predict of one
series at two ranks fails on rank 1 while it sets up the loader), launched by the tests under torchrun or by
Lightning's own launcher.

``python predict_error_script.py ROOT STRATEGY WHERE``: ``STRATEGY`` is ``ddp`` or ``elasticft``; ``WHERE`` is where
the last rank raises: ``between`` (after ``fit``, before ``predict``: the library's own code), ``setup`` (the module's ``setup("predict")``, before the strategy's set-up), ``loader`` (making
the predict loader, before the loop) or ``step`` (in ``predict_step``). Each
process writes ``ROOT/exit-rank<R>.json`` with how long its predict ran and what it raised; it is written before the
error propagates, so a process that stays alive past its error is seen by its missing exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.strategy.models import RandomVectors, TinyRegressor  # noqa: E402


class FailsOnLastRank(TinyRegressor):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def setup(self, stage: str) -> None:
        if stage == "predict" and self.where == "setup" and self.trainer.global_rank == self.trainer.world_size - 1:
            raise AssertionError("the library's own error, on the last rank only")

    def predict_dataloader(self) -> DataLoader:
        if self.where == "loader" and self.trainer.global_rank == self.trainer.world_size - 1:
            raise AssertionError("the library's own error, on the last rank only")
        return DataLoader(RandomVectors(n=8), batch_size=4)

    def predict_step(self, batch, batch_idx):
        if self.where == "step" and self.trainer.global_rank == self.trainer.world_size - 1:
            raise AssertionError("the library's own error, on the last rank only")
        return self.net(batch[0])


def _strategy(name: str):
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    from lightning_ft import ElasticFT3D

    return ElasticFT3D()


if __name__ == "__main__":
    torch.set_num_threads(1)
    root, strategy, where = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    devices = int(os.environ.get("WORLD_SIZE", "0")) or 2  # torchrun's, or Lightning's launcher of 2
    options = dict(accelerator="cpu", devices=devices, default_root_dir=root, logger=False, enable_progress_bar=False)
    model = FailsOnLastRank(where)
    callbacks = [ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2)]
    fit = L.Trainer(strategy=_strategy(strategy), max_steps=4, callbacks=callbacks, **options)
    fit.fit(model)
    rank = fit.global_rank
    predict = L.Trainer(strategy=_strategy(strategy), **options)  # a library's predict makes a Trainer of its own
    start = time.monotonic()
    try:
        if where == "between" and rank == fit.world_size - 1:
            raise AssertionError("the library's own error, on the last rank only")
        predict.predict(model)
        error = None
    except BaseException as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        raise
    finally:
        record = {"predict_s": time.monotonic() - start, "error": error, "pid": os.getpid()}
        (root / f"exit-rank{rank}.json").write_text(json.dumps(record))
