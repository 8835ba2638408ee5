"""Random state of each rank after an elastic resume: its own where it existed, a documented derivation where not.

A checkpoint holds every rank's RNG states (torch, CUDA, numpy, Python). Resumed on the same world size, each rank
gets its own back and the run continues bitwise. Resumed on another world size, rank ``r`` still gets rank ``r``'s
states when the saving world had a rank ``r``; a rank that did not exist at save time (``r >= saved world size``)
starts from states seeded with :func:`new_rank_seed` of the run's seed, the resumed step and its rank, so the same
resume always gives the same streams, and no two new ranks share one.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from lightning_ft import _compat
from lightning_ft.elastic.data_rng import sample_seed

_NEW_RANK_STREAM = 0x6E657752  # keeps these seeds apart from the per-sample seeds of data_rng


def new_rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank`` when it did not exist in the checkpoint of global step ``step``: a 63-bit mix of
    the run's ``seed`` (Lightning's ``PL_GLOBAL_SEED``, 0 when unset), the step and the rank."""
    return sample_seed(seed ^ _NEW_RANK_STREAM, step, rank)


def new_rank_rng_states(seed: int, step: int, rank: int) -> dict[str, Any]:
    """RNG states (in the format of the checkpoint's ``rng`` rank state) seeded with :func:`new_rank_seed`.

    torch (and CUDA, where available) is seeded with the full seed, numpy with its low 32 bits, Python's ``random``
    with the full seed. This process's own RNG states are left as they were.
    """
    saved = _compat.collect_rng_states()
    try:
        value = new_rank_seed(seed, step, rank)
        torch.manual_seed(value)
        np.random.seed(value & 0xFFFFFFFF)
        random.seed(value)
        return _compat.collect_rng_states()
    finally:
        _compat.set_rng_states(saved)


def resumed_rng_states(
    saved: dict[str, Any] | None, *, rank: int, saved_rank: int, step: int, seed: int | None = None
) -> dict[str, Any] | None:
    """The RNG states rank ``rank`` continues with: ``saved`` (the rank state of saved rank ``saved_rank``) when that
    is its own, else :func:`new_rank_rng_states`. ``seed`` defaults to ``PL_GLOBAL_SEED`` (0 when unset). ``None``
    when the checkpoint saved none for its own rank (nothing to restore)."""
    if saved_rank == rank:
        return saved
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return new_rank_rng_states(seed, step, rank)
