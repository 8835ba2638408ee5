"""Replicas that differ between ranks (BatchNorm statistics, a memory bank): each rank resumes its own from an unedited
checkpoint, a user's edit of the shared value reaches every rank, and a replica that differs in a few rows costs those
rows. Two gloo processes; the end-to-end comparison with DDPStrategy is tests/differential's ``edited_replica_state``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from lightning_ft.checkpoint import json_codec
from lightning_ft.strategy import per_rank_state
from tests.helpers import run_distributed


def _state(rank: int) -> dict[str, Any]:
    """A module's state_dict as Lightning saves it, with replicas that differ: BatchNorm statistics everywhere, a
    bank of 256 rows in 4 rows, a weight not at all."""
    state_dict: Any = OrderedDict()
    state_dict["norm.running_mean"] = torch.arange(8, dtype=torch.float32) + rank
    state_dict["bank"] = torch.zeros(256, 64)
    state_dict["bank"][:4] = rank + 1.0
    state_dict["weight"] = torch.ones(3)
    state_dict._metadata = OrderedDict([("", {"version": 1}), ("norm", {"version": 2})])
    return {"state_dict": state_dict, "epoch": 0}


def _round_trip(rank_state: dict[str, Any]) -> dict[str, Any]:
    """The rank state as a load reads it back: JSON plus tensors, as every checkpoint format stores it."""
    tensors: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, path: str) -> str:
        tensors[path] = tensor.clone()
        return path

    return json_codec.decode(json_codec.encode(rank_state, keep), lambda key, _: tensors[key])


def _separate_and_restore(rank: int, world_size: int) -> None:
    own = _state(rank)
    rank_state: dict[str, Any] = {}
    shared = per_rank_state.separate(own, rank_state, parameter_names={"weight"})
    # What every rank loads: the shared state as rank 0 wrote it.
    written = _state(0)
    assert all(torch.equal(shared["state_dict"][k], v) for k, v in written["state_dict"].items())
    entries = {".".join(map(str, e["path"])): e for e in rank_state["per_rank_differences"]}
    if rank == 1:
        # The bank differs in 4 of its 256 rows: only those are kept; the statistics differ everywhere: kept whole.
        assert entries["state_dict.bank"]["rows"].tolist() == [0, 1, 2, 3]
        assert entries["state_dict.norm.running_mean"]["rows"] is None
    else:
        assert all(e.get("values") is None for e in entries.values())  # rank 0's replica is the shared state
    saved = _round_trip(rank_state)

    restored = per_rank_state.restore_own(_state(0), saved, same_world=True)
    for key, value in own["state_dict"].items():
        assert torch.equal(restored["state_dict"][key], value), f"rank {rank}: {key} is not its own replica"
    assert type(restored["state_dict"]) is OrderedDict
    assert restored["state_dict"]._metadata == own["state_dict"]._metadata

    edited = _state(0)
    edited["state_dict"]["bank"] = torch.full((256, 64), 7.0)  # the user's edit of the file
    restored = per_rank_state.restore_own(edited, saved, same_world=True)
    assert torch.equal(restored["state_dict"]["bank"], torch.full((256, 64), 7.0)), f"rank {rank}: the edit was lost"
    assert torch.equal(restored["state_dict"]["norm.running_mean"], own["state_dict"]["norm.running_mean"])

    elsewhere = per_rank_state.restore_own(_state(0), saved, same_world=False)  # another world size: rank 0's
    assert torch.equal(elsewhere["state_dict"]["bank"], written["state_dict"]["bank"])


def test_each_rank_resumes_its_own_replica_unless_the_user_edited_the_shared_value():
    run_distributed(_separate_and_restore, 2)


def test_entries_of_an_earlier_release_are_applied_as_they_were():
    legacy = {"per_rank_tensors": [[["state_dict", "bank"], torch.full((2, 2), 3.0)]]}
    restored = per_rank_state.restore_own(_state(0), legacy, same_world=True)
    assert torch.equal(restored["state_dict"]["bank"], torch.full((2, 2), 3.0))
    assert type(restored["state_dict"]) is OrderedDict and "norm" in restored["state_dict"]._metadata
