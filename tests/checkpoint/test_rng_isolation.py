"""A background save never draws from the training process's random streams (exact resume depends on it)."""

from __future__ import annotations

import random

import numpy as np
import torch

from lightning_ft.checkpoint import AsyncCheckpointer


def _states():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()


def test_saving_a_checkpoint_leaves_python_numpy_and_torch_rngs_untouched(tmp_path):
    writer = AsyncCheckpointer()
    before = _states()
    for step in (1, 2):
        writer.save(tmp_path / f"step={step}", {"w": torch.ones(64), "n": step}, metadata={"step": step})
        writer.wait()
    writer.close()
    after = _states()
    assert before[0] == after[0], "Python's global random was drawn from by the checkpoint writer"
    assert (before[1] == after[1]).all()
    assert torch.equal(before[2], after[2])
