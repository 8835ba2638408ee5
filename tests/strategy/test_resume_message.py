"""The one line rank 0 prints when a checkpoint is loaded: what was resumed and what changed for ``fit``; that
weights were loaded (and nothing resumed) for ``validate``, ``test`` and ``predict``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft.elastic import ElasticPolicy, plan_resume_from_metadata
from lightning_ft.events import read_events
from lightning_ft.strategy.resume_message import resume_message
from tests.strategy.models import TinyRegressor, make_trainer


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
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning-ft: ")]


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
    make_trainer(tmp_path, callbacks=[ckpt], max_steps=4).fit(EvalRegressor())
    caplog.clear()
    return tmp_path / "ckpt" / "epoch=0-step=4.ckpt"


def test_fit_prints_one_resume_line_on_the_same_world(tmp_path, caplog, trained):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    make_trainer(tmp_path, callbacks=[ckpt], max_steps=6).fit(EvalRegressor())
    assert _lines(caplog) == [
        f"lightning-ft: resuming from {trained} (step 4): world size 1 (unchanged), gradient accumulation 1"
        " (unchanged), LR x1.00 (unchanged)"
    ]


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
    from lightning_ft.checkpoint import COMMIT_MARKER, METADATA_FILE

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
