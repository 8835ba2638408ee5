"""GoodputMonitor's ``goodput/*`` figures are the report's: one measurement of productive time, data wait and
checkpoint stalls, whichever strategy runs.

Under ``ElasticFT3D`` the strategy's tracker times the loop (its save calls measured) and writes ``progress``; the
monitor logs that same timer. Under another strategy the monitor times the loop and writes ``progress`` itself. Either
way ``lightning-ft report`` sums the ``progress`` lines, so the last value each tag logs is the report's figure. The
run has a real data wait (a dataset that sleeps), two epochs (the wait for each epoch's first batch) and checkpoint
saves inside training and after its last batch.
"""

from __future__ import annotations

import csv
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_ft import ElasticFT3D
from lightning_ft.events import read_events
from lightning_ft.monitors import GoodputMonitor
from lightning_ft.monitors.goodput_report import summarize
from tests.monitors.tiny_module import TinyModule
from tests.strategy.conftest import _release_lightning_process_group  # noqa: F401 - autouse: ElasticFT3D's group

TAGS = ("productive_s", "data_wait_s", "checkpoint_stall_s")


class SlowData(Dataset):
    """Eight batches of two per epoch; each sample takes 4 ms to load."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        time.sleep(0.004)
        return (torch.full((4,), float(i)),)


def _last_logged(root) -> dict[str, float]:
    with open(root / "logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("goodput/data_wait_s")]
    return {tag: float(rows[-1][f"goodput/{tag}"]) for tag in TAGS}


@pytest.mark.parametrize("strategy", ["elastic_ft3d", "auto"])
def test_the_logged_goodput_figures_are_the_report_s(tmp_path, strategy):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticFT3D() if strategy == "elastic_ft3d" else "auto",
        max_steps=16,
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path, name="logs", version=0),
        log_every_n_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            GoodputMonitor(),
            ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, save_last=True),
        ],
    )
    trainer.fit(TinyModule(), DataLoader(SlowData(), batch_size=2))
    report = summarize(read_events(tmp_path))["totals"]
    logged = _last_logged(tmp_path)
    assert logged["data_wait_s"] >= 16 * 2 * 0.004 * 0.9  # the loads are in it
    if strategy == "elastic_ft3d":
        assert logged["checkpoint_stall_s"] > 0  # measured save calls
    for tag in TAGS:
        assert logged[tag] == pytest.approx(report[tag], rel=1e-6, abs=1e-6), tag
