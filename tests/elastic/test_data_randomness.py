"""Randomness in the data pipeline under ElasticFT3D: drawn as under DDPStrategy, and restored exactly at a resume.

A dataset that augments in ``__getitem__`` with torch's, numpy's and Python's global RNGs and a model with dropout
train under ``ElasticFT3D`` to the same weights as under ``DDPStrategy``, bit for bit. A run stopped at a checkpoint
(in the middle of an epoch, or at its end) and fitted again from it ends with the weights of an uninterrupted run.
DataLoader workers draw from streams a resume cannot restore mid-epoch: the opt-in ``data_randomness="per_sample"``
makes that exact, and without it the resume says once why it is not.
"""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_ft import ElasticFT3D
from tests.elastic.data_randomness import Augmented, fit

# 40 samples, batch 4, one device: 10 steps per epoch. Step 6 is mid-epoch 0, step 10 ends it; 14 is mid-epoch 1.
TOTAL_STEPS = 14
NOT_EXACT = "this resume is not exact"


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{name} differs"


def resumed_run(root, *, stop_at: int, strategy_kwargs: dict, **kwargs) -> tuple[dict, dict]:
    """Fit to ``stop_at`` (saving there), then fit a new Trainer to TOTAL_STEPS: it auto-resumes from that save."""
    _, first = fit(root, strategy=ElasticFT3D(**strategy_kwargs), max_steps=stop_at, ckpt_every=stop_at, **kwargs)
    assert max(first) == stop_at
    weights, second = fit(
        root, strategy=ElasticFT3D(**strategy_kwargs), max_steps=TOTAL_STEPS, ckpt_every=stop_at, **kwargs
    )
    assert min(second) == stop_at + 1, "the second fit did not resume from the save"
    return weights, second


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_augmenting_dataset_with_dropout_trains_to_the_weights_of_ddp_strategy(tmp_path, num_workers):
    ddp, ddp_losses = fit(tmp_path / "ddp", strategy=DDPStrategy(), max_steps=TOTAL_STEPS, num_workers=num_workers)
    ours, our_losses = fit(tmp_path / "ft", strategy=ElasticFT3D(), max_steps=TOTAL_STEPS, num_workers=num_workers)
    assert our_losses == ddp_losses
    assert_same_weights(ours, ddp)


@pytest.mark.parametrize("stop_at", [6, 10], ids=["mid-epoch", "epoch-end"])
def test_a_resume_restores_the_data_randomness_and_dropout_exactly(tmp_path, stop_at, caplog):
    reference, ref_losses = fit(tmp_path / "ref", strategy=ElasticFT3D(), max_steps=TOTAL_STEPS, ckpt_every=stop_at)
    with caplog.at_level(logging.INFO):
        weights, losses = resumed_run(tmp_path / "run", stop_at=stop_at, strategy_kwargs={})
    assert losses == {step: ref_losses[step] for step in losses}
    assert_same_weights(weights, reference)
    assert not any(NOT_EXACT in r.getMessage() for r in caplog.records)
