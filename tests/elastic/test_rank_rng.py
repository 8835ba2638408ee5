"""Ranks that did not exist at save time get documented, deterministic RNG states; others get their own."""

from __future__ import annotations

import random

import numpy as np
import torch

from lightning_ft.elastic import new_rank_seed
from lightning_ft.elastic.internal import new_rank_rng_states, resumed_rng_states


def test_a_rank_that_existed_gets_its_own_saved_states():
    saved = {"torch": torch.get_rng_state()}
    assert resumed_rng_states(saved, rank=1, saved_rank=1, step=5) is saved


def test_a_new_rank_gets_states_seeded_from_the_run_seed_the_step_and_its_rank(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "1234")
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    states = resumed_rng_states({"torch": torch.get_rng_state()}, rank=3, saved_rank=1, step=40)
    # The caller's own streams are untouched.
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()
    torch.manual_seed(new_rank_seed(1234, 40, 3))
    assert torch.equal(states["torch"], torch.get_rng_state())
    again = new_rank_rng_states(1234, 40, 3)
    assert torch.equal(again["torch"], states["torch"]) and again["python"] == states["python"]
    others = [new_rank_rng_states(1234, 40, r)["torch"] for r in (2, 4)] + [new_rank_rng_states(1234, 41, 3)["torch"]]
    assert not any(torch.equal(o, states["torch"]) for o in others)
