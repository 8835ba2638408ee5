"""ElasticFT3D applies the ElasticPolicy from the new Trainer's settings, and the optimizer shows the rate it uses.

A single process can change the global batch without changing the world: a new per-device batch or a new
``accumulate_grad_batches`` is decided exactly like a new data-parallel size (same policy, same arithmetic).

The one line rank 0 prints when a checkpoint is loaded says what was resumed and what changed for ``fit``, and that
weights were loaded (and nothing resumed) for ``validate``, ``test`` and ``predict``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader

from lightning_ft import ElasticFT3D, ElasticPolicy
from lightning_ft.checkpoint import list_committed
from lightning_ft.elastic.internal import plan_resume_from_metadata
from lightning_ft.events import read_events
from lightning_ft.strategy.elastic_resume import resume_message
from tests.helpers import as_a_new_process
from tests.strategy.models import RandomVectors, TinyRegressor, make_trainer

pytestmark = pytest.mark.usefixtures("event_log_on_disk")  # these runs read their event log

BASE_LR = 0.1


class StepScheduledRegressor(TinyRegressor):
    """StepLR stepped every optimizer step (chainable: it reads the rate in the optimizer), batch size chosen."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__(lr=BASE_LR)
        self.batch_size = batch_size

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomVectors(), batch_size=self.batch_size, shuffle=True)


class MetricsLogger(Logger):
    """Keeps what LearningRateMonitor logs (what a TensorBoard user would read)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.setdefault(int(step or 0), {}).update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class RatesUsed(Callback):
    """The rate the optimizer really steps with (a pre-hook on the torch optimizer), per global step."""

    def __init__(self) -> None:
        self.used: dict[int, float] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: self.used.__setitem__(trainer.global_step, opt.param_groups[0]["lr"])
        )


def fit(root, *, max_steps, batch_size, policy, accumulate=1):
    as_a_new_process()  # each call stands for a launch
    logger, used = MetricsLogger(), RatesUsed()
    trainer = make_trainer(
        root,
        strategy=ElasticFT3D(elastic=policy),
        callbacks=[
            ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1),
            LearningRateMonitor(logging_interval="step"),
            used,
        ],
        logger=logger,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(StepScheduledRegressor(batch_size))
    return trainer, used.used, {step: m["lr-SGD"] for step, m in logger.metrics.items() if "lr-SGD" in m}


def test_a_keep_local_ramp_continues_across_resumes_and_the_optimizer_shows_the_rate_it_uses(tmp_path):
    policy = ElasticPolicy(batch="keep_local", lr_scaling="linear", lr_warmup_steps=4)
    fit(tmp_path, max_steps=4, batch_size=4, policy=policy)
    # Half the per-device batch: half the global batch, so the rate ramps to half over 4 steps from step 4.
    _, used_a, logged_a = fit(tmp_path, max_steps=6, batch_size=2, policy=policy)
    # Resumed again at step 6, on the same settings, in the middle of the ramp: the ramp goes on to 0.5.
    _, used_b, logged_b = fit(tmp_path, max_steps=10, batch_size=2, policy=policy)

    def ramp(step: int) -> float:
        return 1.0 + (0.5 - 1.0) * min(step - 4, 4) / 4

    expected = {s: BASE_LR * 0.5 ** (s // 3) * ramp(s) for s in range(4, 10)}
    assert {**used_a, **used_b} == pytest.approx(expected)
    # What LearningRateMonitor logged for a step is what that step used.
    logged = {**logged_a, **logged_b}
    assert {s: logged[s] for s in expected if s in logged} == pytest.approx(
        {s: expected[s] for s in logged if s in expected}
    )
    assert len(set(logged) & set(expected)) >= 5
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert [(e["step"], e["lr_scale"], e["global_batch_after"]) for e in resumed] == [(4, 0.5, 2), (6, 1.0, 2)]
    assert resumed[1]["lr_scale_now"] == pytest.approx(0.75) and resumed[1]["lr_scale_target"] == 0.5


def test_keep_global_with_a_smaller_per_device_batch_accumulates_to_the_saved_global_batch(tmp_path):
    fit(tmp_path, max_steps=2, batch_size=4, policy=ElasticPolicy())
    trainer, _, _ = fit(tmp_path, max_steps=4, batch_size=2, policy=ElasticPolicy())
    assert trainer.accumulate_grad_batches == 2
    (event,) = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert (event["accumulate_grad_batches"], event["global_batch_before"], event["global_batch_after"]) == (2, 4, 4)
    assert event["load_s"] >= 0 and event["first_step_s"] is not None
    # The first micro-batch after the resume leaves the step count at 2; the resumed state is not saved again there,
    # half-way through an accumulation.
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "checkpoint_committed"] == [2, 4]


@pytest.mark.parametrize(
    ("batch_size", "accumulate", "match"),
    [
        (4, 3, r"Trainer\(accumulate_grad_batches=3\) with per-device batch 4 x data-parallel size 1 gives 12"),
        (3, 1, r"not a multiple of per-device batch 3 .* a per-device batch that divides 4"),
    ],
)
def test_keep_global_that_cannot_keep_the_global_batch_fails_before_training(tmp_path, batch_size, accumulate, match):
    fit(tmp_path, max_steps=2, batch_size=4, policy=ElasticPolicy())
    with pytest.raises(ValueError, match=match):
        fit(tmp_path, max_steps=4, batch_size=batch_size, policy=ElasticPolicy(), accumulate=accumulate)
    assert [c.step for c in list_committed(tmp_path / "ckpt")] == [2]


def test_keep_local_trains_with_the_accumulation_the_user_set(tmp_path):
    fit(tmp_path, max_steps=2, batch_size=4, policy=ElasticPolicy(batch="keep_local"))
    trainer, _, _ = fit(tmp_path, max_steps=3, batch_size=4, policy=ElasticPolicy(batch="keep_local"), accumulate=2)
    assert trainer.accumulate_grad_batches == 2
    (event,) = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert (event["global_batch_after"], event["lr_scale"]) == (8, 2.0)


class EvalRegressor(TinyRegressor):
    def validation_step(self, batch, batch_idx):
        return None

    def test_step(self, batch, batch_idx):
        return None

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def val_dataloader(self):
        return self.train_dataloader()

    test_dataloader = predict_dataloader = val_dataloader


def _lines(caplog) -> list[str]:
    """lightning-ft's console lines about the resume (the set-up line naming the checkpoint format left out)."""
    return [
        m
        for r in caplog.records
        if (m := r.getMessage()).startswith("lightning-ft: ") and not m.startswith("lightning-ft: checkpoints are ")
    ]


def _metadata(**overrides):
    metadata = {
        "step": 8,
        "world_size": 2,
        "mesh": {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 1},
        "per_device_batch_size": 4,
        "accumulate_grad_batches": 1,
        "lr_scale": 1.0,
    }
    metadata.update(overrides)
    return metadata


def test_the_line_says_what_changed_when_the_world_shrinks_with_keep_global():
    metadata = _metadata(world_size=4, mesh={"data_parallel": 4})
    decision = plan_resume_from_metadata(ElasticPolicy(), metadata, new_dp_size=2, new_world_size=2)
    assert resume_message(Path("ckpt/epoch=0-step=8.ckpt"), metadata, decision=decision, world_size=2) == (
        "lightning-ft: resuming from ckpt/epoch=0-step=8.ckpt (step 8): world size 4 -> 2,"
        " gradient accumulation 1 -> 2, LR x1.00 (unchanged)"
    )


def test_the_line_shows_the_lr_factor_with_keep_local_and_carries_earlier_resumes():
    metadata = _metadata(lr_scale=0.5)
    policy = ElasticPolicy(batch="keep_local", lr_scaling="linear", lr_warmup_steps=100)
    decision = plan_resume_from_metadata(policy, metadata, new_dp_size=3, new_world_size=3)
    assert resume_message(Path("c"), metadata, decision=decision, world_size=3) == (
        "lightning-ft: resuming from c (step 8): world size 2 -> 3, gradient accumulation 1 (unchanged),"
        " LR x0.50 -> x0.75 (ramped in over 100 steps)"
    )


@pytest.fixture
def trained(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    # A folder: a test below rewrites its metadata file as if two ranks had written it.
    strategy = ElasticFT3D(checkpoint_format="torchsnapshot")
    make_trainer(tmp_path, strategy=strategy, callbacks=[ckpt], max_steps=4).fit(EvalRegressor())
    caplog.clear()
    as_a_new_process()  # the tests relaunch after it
    return tmp_path / "ckpt" / "epoch=0-step=4.ckpt"


def test_fit_prints_one_resume_line_on_the_same_world(tmp_path, caplog, trained):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    make_trainer(tmp_path, callbacks=[ckpt], max_steps=6).fit(EvalRegressor())
    assert _lines(caplog) == [
        f"lightning-ft: resuming from {trained} (step 4): world size 1 (unchanged), gradient accumulation 1"
        " (unchanged), LR x1.00 (unchanged)"
    ]


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_says_weights_were_loaded_and_resumes_nothing(tmp_path, caplog, trained, stage):
    resumed_before = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    trainer = make_trainer(tmp_path, max_steps=1, enable_checkpointing=False)
    getattr(trainer, stage)(EvalRegressor(), ckpt_path=str(trained))
    assert _lines(caplog) == [f"lightning-ft: loaded weights from {trained} (step 4) for {stage}"]
    assert [e for e in read_events(tmp_path) if e["event"] == "resumed"] == resumed_before


def test_evaluating_a_checkpoint_from_another_world_size_needs_no_elastic_policy(tmp_path, caplog, trained):
    import json
    import zlib

    from lightning_ft import ElasticFT3D
    from lightning_ft.checkpoint.internal import COMMIT_MARKER, METADATA_FILE

    # As if two ranks had written it: an elastic *resume* would need a policy; loading weights to evaluate does not.
    document = json.loads((trained / METADATA_FILE).read_text())
    document["metadata"]["world_size"] = 2
    document["metadata"]["mesh"] = {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 1}
    document["rank_states"].append(document["rank_states"][0])  # what the second rank would have kept
    data = json.dumps(document).encode()
    (trained / METADATA_FILE).write_bytes(data)
    marker = json.loads((trained / COMMIT_MARKER).read_text())
    marker["metadata_crc32"] = zlib.crc32(data)
    (trained / COMMIT_MARKER).write_text(json.dumps(marker))

    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(elastic=None), enable_checkpointing=False)
    trainer.validate(EvalRegressor(), ckpt_path=str(trained))
    assert _lines(caplog) == [f"lightning-ft: loaded weights from {trained} (step 4) for validate"]
    with pytest.raises(ValueError, match="needs elastic=ElasticPolicy"):
        make_trainer(tmp_path, strategy=ElasticFT3D(elastic=None), max_steps=6).fit(
            EvalRegressor(), ckpt_path=str(trained)
        )


def test_a_resume_with_nothing_left_to_train_prints_its_line_before_lightning_says_fit_stopped(
    tmp_path, caplog, trained
):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    make_trainer(tmp_path, callbacks=[ckpt], max_steps=4).fit(EvalRegressor())
    messages = [r.getMessage() for r in caplog.records]
    resume = [i for i, m in enumerate(messages) if m.startswith("lightning-ft: resuming from")]
    stopped = [i for i, m in enumerate(messages) if "`Trainer.fit` stopped" in m]
    assert len(resume) == 1 and stopped and resume[0] < stopped[0], messages
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [4]
