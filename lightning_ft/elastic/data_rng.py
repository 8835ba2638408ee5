"""Per-sample seeding of the data pipeline: the opt-in ``ElasticFT3D(data_randomness="per_sample")``.

A dataset that draws random numbers in ``__getitem__`` (augmentation) draws them from whatever state the RNGs are in
when the batch is fetched: the main process's global stream (``num_workers=0``), which a resume restores exactly, or
each worker's own stream (``num_workers > 0``), seeded from a base seed the DataLoader iterator draws when it is
created. A resume in the middle of an epoch starts fresh workers whose streams are not where the old ones were, so
that randomness cannot be restored from a checkpoint. By default ``ElasticFT3D`` leaves all of this as it is under
``DDPStrategy`` (the same numbers are drawn; see ``docs/strategy.md`` for what resumes exactly).

With the option on, the :class:`~lightning_ft.elastic.ResumableSampler` yields :class:`SeededIndex` values (plain
ints that also carry a seed derived from the sampler's seed, the epoch and the sample's position in the epoch's
global order), and :func:`install_seeded_fetch` gives the dataset a ``__getitems__`` that fetches each sample with
torch's (CPU), Python's and numpy's RNGs seeded from it and puts the caller's states back afterwards. A sample is
then augmented the same way whichever process, worker or world size fetches it, before or after a resume, and data
loading no longer consumes the training loop's random stream. The numbers drawn are not those ``DDPStrategy`` draws.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_MASK_63 = (1 << 63) - 1


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """A seed for the sample at ``position`` of ``epoch``'s global order (a 63-bit mix, no collisions in practice)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & _MASK_63
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93) & _MASK_63


class SeededIndex(int):
    """A dataset index that carries the seed its sample is fetched with. Behaves as the int it is everywhere else."""

    seed: int

    def __new__(cls, value: int, seed: int) -> SeededIndex:
        obj = super().__new__(cls, value)
        obj.seed = seed
        return obj

    def __reduce__(self) -> tuple[Any, ...]:  # travels to DataLoader workers by pickle
        return (SeededIndex, (int(self), self.seed))


class SeededFetch:
    """A dataset's ``__getitems__`` that seeds the RNGs per sample from :class:`SeededIndex` values.

    Indices that are not :class:`SeededIndex` (another sampler, validation) are fetched as the dataset would fetch
    them. A dataset with its own ``__getitems__`` keeps it; its batch is then seeded once, from its first index.
    """

    def __init__(self, dataset: Any, inner: Any = None) -> None:
        self.dataset = dataset
        self.inner = inner

    def __call__(self, indices: Sequence[Any]) -> list[Any]:
        seeded = len(indices) > 0 and isinstance(indices[0], SeededIndex)
        if not seeded:
            return self.inner(indices) if self.inner is not None else [self._get(i) for i in indices]
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        try:
            if self.inner is not None:
                _seed_all(indices[0].seed)
                return self.inner(indices)
            out = []
            for index in indices:
                _seed_all(index.seed)
                out.append(self._get(index))
            return out
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def _get(self, index: Any) -> Any:
        return type(self.dataset).__getitem__(self.dataset, index)


def _seed_all(seed: int) -> None:
    # The CPU generator only: torch.manual_seed would also reseed every CUDA generator, which the fetch must not touch
    # (only the CPU state is put back afterwards).
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)


def install_seeded_fetch(dataset: Any) -> bool:
    """Give ``dataset`` (a map-style dataset object) the seeded ``__getitems__``; True if it has it now.

    The attribute is set on the instance, so the user's class stays what it is; it travels with the dataset to
    DataLoader workers. A dataset that refuses new attributes keeps fetching as before (False).
    """
    current = getattr(dataset, "__getitems__", None)
    if isinstance(current, SeededFetch):
        return True
    try:
        dataset.__getitems__ = SeededFetch(dataset, inner=current)
    except (AttributeError, TypeError):
        return False
    return True


DATA_RANDOMNESS = ("ddp", "per_sample")
"""The values of ``ElasticFT3D(data_randomness=...)``: ``"ddp"`` (default) draws what ``DDPStrategy`` draws;
``"per_sample"`` seeds every training sample's fetch from its place in the epoch."""
