"""Randomness in the data pipeline under ElasticFT3D: drawn as under DDPStrategy, and restored exactly at a resume.

A dataset that augments in ``__getitem__`` with torch's, numpy's and Python's global RNGs and a model with dropout
train under ``ElasticFT3D`` to the same weights as under ``DDPStrategy``, bit for bit. A run stopped at a checkpoint
(in the middle of an epoch, or at its end) and fitted again from it ends with the weights of an uninterrupted run.
DataLoader workers draw from streams a resume cannot restore mid-epoch: the opt-in ``data_randomness="per_sample"``
makes that exact, and without it the resume says once why it is not.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from lightning_ft import ElasticFT3D
from lightning_ft.elastic.data_rng import SeededIndex, install_seeded_fetch
from tests.elastic.data_randomness import Augmented, fit


class OtherAugmented(Augmented):
    pass


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


@pytest.mark.parametrize(
    ("stop_at", "num_workers"),
    [(6, 0), (10, 0), (10, 2)],
    ids=["mid-epoch", "epoch-end", "epoch-end-with-workers"],
)
def test_a_resume_restores_the_data_randomness_and_dropout_exactly(tmp_path, stop_at, num_workers, caplog):
    # At an epoch end the workers of the next epoch are seeded from the restored stream, as in the uninterrupted run.
    reference, ref_losses = fit(
        tmp_path / "ref", strategy=ElasticFT3D(), max_steps=TOTAL_STEPS, ckpt_every=stop_at, num_workers=num_workers
    )
    with caplog.at_level(logging.INFO):
        weights, losses = resumed_run(tmp_path / "run", stop_at=stop_at, strategy_kwargs={}, num_workers=num_workers)
    assert losses == {step: ref_losses[step] for step in losses}
    assert_same_weights(weights, reference)
    assert not any(NOT_EXACT in r.getMessage() for r in caplog.records)


def test_per_sample_seeding_resumes_exactly_with_workers(tmp_path, caplog):
    per_sample = {"data_randomness": "per_sample"}
    reference, _ = fit(
        tmp_path / "ref", strategy=ElasticFT3D(**per_sample), max_steps=TOTAL_STEPS, ckpt_every=6, num_workers=2
    )
    with caplog.at_level(logging.INFO):
        weights, _ = resumed_run(tmp_path / "run", stop_at=6, strategy_kwargs=per_sample, num_workers=2)
    assert_same_weights(weights, reference)
    assert not any(NOT_EXACT in r.getMessage() for r in caplog.records)


def test_per_sample_seeding_resumes_exactly_with_two_loaders_in_workers(tmp_path):
    # Each loader's iterator draws a base seed from the main process's stream when Lightning creates it.
    def loaders() -> dict[str, DataLoader]:
        return {
            "a": DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=1),
            "b": DataLoader(OtherAugmented(20), batch_size=4, shuffle=True, num_workers=1),
        }

    per_sample = {"data_randomness": "per_sample"}
    reference, _ = fit(
        tmp_path / "ref", strategy=ElasticFT3D(**per_sample), max_steps=TOTAL_STEPS, ckpt_every=6, loader=loaders()
    )
    weights, _ = resumed_run(tmp_path / "run", stop_at=6, strategy_kwargs=per_sample, loader=loaders())
    assert_same_weights(weights, reference)


def test_per_sample_seeding_trains_to_the_same_weights_with_or_without_workers(tmp_path):
    per_sample = {"data_randomness": "per_sample"}
    inline, _ = fit(tmp_path / "w0", strategy=ElasticFT3D(**per_sample), max_steps=TOTAL_STEPS, num_workers=0)
    workers, _ = fit(tmp_path / "w2", strategy=ElasticFT3D(**per_sample), max_steps=TOTAL_STEPS, num_workers=2)
    assert_same_weights(workers, inline)


def test_per_sample_seeding_says_once_at_start_which_datasets_it_wraps(tmp_path, caplog):
    loaders = {
        "a": DataLoader(Augmented(), batch_size=4, shuffle=True),
        "b": DataLoader(OtherAugmented(24), batch_size=4, shuffle=True),
        "c": DataLoader(Augmented(16), batch_size=4, shuffle=True),
    }
    with caplog.at_level(logging.INFO):
        fit(tmp_path, strategy=ElasticFT3D(data_randomness="per_sample"), max_steps=3, loader=loaders)
    said = [r.getMessage() for r in caplog.records if "data_randomness='per_sample'" in r.getMessage()]
    assert len(said) == 1
    assert "the training datasets Augmented, OtherAugmented fetch every sample" in said[0]
    assert "differ from DDPStrategy's" in said[0]


def test_without_the_option_nothing_is_said_and_no_dataset_is_wrapped(tmp_path, caplog):
    dataset = Augmented()
    with caplog.at_level(logging.INFO):
        fit(tmp_path, strategy=ElasticFT3D(), max_steps=3, loader=DataLoader(dataset, batch_size=4, shuffle=True))
    assert "__getitems__" not in vars(dataset)
    assert not any("data_randomness" in r.getMessage() for r in caplog.records)


def test_without_per_sample_seeding_a_mid_epoch_resume_with_workers_says_once_why_it_is_not_exact(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        resumed_run(tmp_path, stop_at=6, strategy_kwargs={}, num_workers=2)
    said = [r.getMessage() for r in caplog.records if NOT_EXACT in r.getMessage()]
    assert len(said) == 1
    assert "randomness drawn in the 2 DataLoader workers" in said[0]
    assert "data_randomness='per_sample'" in said[0]


class WithGetitems(Augmented):
    """Fetches a whole batch at once, as a dataset with ``__getitems__`` does."""

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        noise = torch.rand(len(indices), self.x.shape[1]) * 0.1
        return [(self.x[i] + n, self.y[i]) for i, n in zip(indices, noise, strict=True)]


class Stream(IterableDataset):
    """An endless stream of augmented samples."""

    def __init__(self) -> None:
        self.data = Augmented()

    def __iter__(self):
        while True:
            yield self.data[random.randrange(len(self.data))]


class Reversed(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


class PairsSwapped(BatchSampler):
    """A user's batch sampler: Lightning can re-create it around its distributed sampler (same arguments)."""

    def __iter__(self):
        for batch in super().__iter__():
            yield batch[::-1]


def custom_loader(kind: str) -> DataLoader:
    if kind == "own __getitems__":
        return DataLoader(WithGetitems(), batch_size=4, shuffle=True)
    if kind == "IterableDataset":
        return DataLoader(Stream(), batch_size=4)
    if kind == "sampler":
        return DataLoader(Augmented(), batch_size=4, sampler=Reversed(40))
    return DataLoader(Augmented(), batch_sampler=PairsSwapped(Reversed(40), batch_size=4, drop_last=False))


KINDS = ["own __getitems__", "IterableDataset", "sampler", "batch sampler"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_users_dataset_sampler_or_batch_sampler_trains_as_under_ddp_strategy_untouched(tmp_path, kind):
    ddp, ddp_losses = fit(tmp_path / "ddp", strategy=DDPStrategy(), max_steps=8, loader=custom_loader(kind))
    loader = custom_loader(kind)
    getitems = vars(loader.dataset).get("__getitems__")
    ours, our_losses = fit(tmp_path / "ft", strategy=ElasticFT3D(), max_steps=8, loader=loader)
    assert vars(loader.dataset).get("__getitems__") is getitems, "the dataset was given another __getitems__"
    assert our_losses == ddp_losses
    assert_same_weights(ours, ddp)


def test_a_plain_random_sampler_without_lightnings_distributed_sampler_is_kept_as_under_ddp_strategy(tmp_path):
    # With use_distributed_sampler=False, DDPStrategy keeps the user's RandomSampler: its order comes from the global RNG.
    def loader() -> DataLoader:
        return DataLoader(Augmented(), batch_size=4, shuffle=True)

    options = {"max_steps": 8, "use_distributed_sampler": False}
    ddp, ddp_losses = fit(tmp_path / "ddp", strategy=DDPStrategy(), loader=loader(), **options)
    ours, our_losses = fit(tmp_path / "ft", strategy=ElasticFT3D(), loader=loader(), **options)
    assert our_losses == ddp_losses
    assert_same_weights(ours, ddp)


def test_a_dataset_with_its_own_getitems_resumes_exactly(tmp_path, caplog):
    reference, _ = fit(
        tmp_path / "ref",
        strategy=ElasticFT3D(),
        max_steps=TOTAL_STEPS,
        ckpt_every=6,
        loader=custom_loader("own __getitems__"),
    )
    with caplog.at_level(logging.INFO):
        weights, _ = resumed_run(
            tmp_path / "run", stop_at=6, strategy_kwargs={}, loader=custom_loader("own __getitems__")
        )
    assert_same_weights(weights, reference)
    assert not any(NOT_EXACT in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("IterableDataset", "the training DataLoader over the IterableDataset Stream does not save its position"),
        ("sampler", "sampler DistributedSamplerWrapper (Lightning's wrapper of a custom sampler) does not save"),
        ("batch sampler", "the training DataLoader's batch sampler PairsSwapped does not save its position"),
    ],
)
def test_a_mid_epoch_resume_of_a_loader_without_a_saved_position_says_once_why_it_is_not_exact(
    tmp_path, caplog, kind, reason
):
    _, first = fit(tmp_path, strategy=ElasticFT3D(), max_steps=6, ckpt_every=6, loader=custom_loader(kind))
    with caplog.at_level(logging.INFO):
        fit(tmp_path, strategy=ElasticFT3D(), max_steps=8, ckpt_every=6, loader=custom_loader(kind))
    said = [r.getMessage() for r in caplog.records if NOT_EXACT in r.getMessage()]
    assert len(said) == 1
    assert reason in said[0]
    # Without a length Lightning fetches one batch ahead, before the save: that is said too.
    assert ("Lightning fetched the batch after the save before the save" in said[0]) == (kind == "IterableDataset")


@pytest.mark.parametrize("value", ["per-sample", None, True])
def test_an_unknown_data_randomness_is_refused_at_construction_naming_the_option_and_the_choices(value):
    with pytest.raises(ValueError) as raised:
        ElasticFT3D(data_randomness=value)
    assert f"ElasticFT3D(data_randomness={value!r}): must be one of 'ddp', 'per_sample'" in str(raised.value)


def test_a_seeded_fetch_seeds_only_the_cpu_generator_and_puts_the_callers_states_back(monkeypatch):
    reseeded_cuda = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded_cuda.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: reseeded_cuda.append(seed))
    dataset = Augmented()
    assert install_seeded_fetch(dataset)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    first = dataset.__getitems__([SeededIndex(3, seed=11), SeededIndex(5, seed=12)])
    again = dataset.__getitems__([SeededIndex(3, seed=11), SeededIndex(5, seed=12)])
    assert reseeded_cuda == []
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


@pytest.mark.gpu
def test_a_seeded_fetch_leaves_the_cuda_generators_where_they_were():
    torch.cuda.manual_seed_all(5)
    torch.rand(3, device="cuda")
    before = torch.cuda.get_rng_state_all()
    dataset = Augmented()
    install_seeded_fetch(dataset)
    dataset.__getitems__([SeededIndex(1, seed=2), SeededIndex(4, seed=9)])
    assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all(), strict=True))
