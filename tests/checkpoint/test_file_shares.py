"""A checkpoint file written by every rank: each rank stages and checksums only the bytes it writes (about 1/N), the
capture is still the state at the save call, a diverged replica gives the file rank 0's copy (as DDPStrategy), and ranks whose tensors lie differently
in their storages are refused before a byte is written (lightning_ft/checkpoint/parallel_file.py, staging.py,
file_commit.py)."""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_ft.checkpoint import AsyncCheckpointer, list_committed
from lightning_ft.checkpoint import parallel_file as pf
from lightning_ft.checkpoint.single_file import RECORD_KEY, FileStorage, is_checkpoint_file, load_file
from tests.helpers import run_distributed

BIG = 600_000  # float32: 2.4 MB, cut between the ranks inside it


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "state_dict": {
            "big": torch.randn(BIG, generator=g),
            "w": torch.randn(300, 200, generator=g),
            "t": torch.randn(70, 90, generator=g).t(),  # not contiguous: staged whole, written in shares
            "small": torch.randn(5, generator=g),
            "empty": torch.empty(0, 3),
            "ints": torch.arange(1000, dtype=torch.int16),
        },
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(40_000, generator=g)}}, "param_groups": []}],
        "global_step": step,
        "hyper_parameters": {"name": "shares"},
    }


def _tensor_bytes(state: dict) -> int:
    total = 0

    def walk(value):
        nonlocal total
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(state)
    return total


def _equal(expected, actual, where="") -> None:
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, where
        assert torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert set(expected) <= set(actual), where
        for k in expected:
            _equal(expected[k], actual[k], f"{where}/{k}")
    elif isinstance(expected, list):
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _equal(e, a, f"{where}/{i}")
    else:
        assert expected == actual, where


# -- The shares, before the layout is known ------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 5])
@pytest.mark.parametrize("pickle_size", [100, 4000, 70_001])
def test_each_rank_writes_only_bytes_of_its_staged_range_whatever_the_pickle_size(world_size, pickle_size) -> None:
    sizes = [10, 10_000_000, 0, 3_000_001, 7, 5000]
    shares = pf.nominal_shares(sizes, world_size)
    names = [("data.pkl", pickle_size)] + [(f"data/{k}", n) for k, n in enumerate(sizes)]
    names += [("version", 2), (".data/serialization_id", 40)]
    layout = pf.plan_layout(
        "a",
        names,
        storage_count=len(sizes),
        world_size=world_size,
        shares={f"data/{k}": r for k, r in enumerate(shares) if r},
    )
    covered: dict[int, int] = {}
    per_rank = [0] * world_size
    for piece in layout.pieces:
        record = layout.records[piece.record]
        k = int(record.name.removeprefix("data/"))
        assert piece.start == covered.get(piece.record, 0)  # contiguous, in order, no overlap
        covered[piece.record] = piece.start + piece.length
        lo, hi = pf.staged_range(shares[k], piece.rank)
        assert lo <= piece.start and piece.start + piece.length <= hi, (piece, lo, hi)  # what it staged, no more
        if piece.start:  # a cut inside a storage falls on a page of the file
            assert (record.data_offset + piece.start) % pf.CUT_ALIGNMENT_BYTES == 0
        per_rank[piece.rank] += piece.length
    assert covered == {i: r.size for i, r in enumerate(layout.records) if r.name.startswith("data/") and r.size}
    total = sum(sizes)
    assert all(abs(n - total / world_size) <= pf.CUT_ALIGNMENT_BYTES + 1 for n in per_rank), per_rank


# -- Ranks whose tensors lie differently in storages of the same sizes ---------------------------------------------------


def _layouts(rank: int) -> list[dict]:
    base = torch.arange(40, dtype=torch.float32)
    other = torch.arange(12, dtype=torch.float32)
    return [
        # Two views of one storage, at other offsets on rank 1: the same storage sizes, shapes and dtypes.
        {"a": base[0:20], "b": base[20:40]} if rank == 0 else {"a": base[20:40], "b": base[0:20]},
        # The same shape over a storage of the same size, other strides (a transposed matrix).
        {"w": other.view(3, 4)} if rank == 0 else {"w": other.view(4, 3).t()},
        # One storage of 80 bytes on rank 0; on rank 1 a view of the first half of one, the second tensor elsewhere.
        {"a": base[:20], "b": base[20:]} if rank == 0 else {"a": base[:20], "b": base[:20].clone() + 20},
    ]


def _refuse_other_layouts(rank: int, world_size: int, folder: str) -> None:
    for n, obj in enumerate(_layouts(rank)):
        path = os.path.join(folder, f"layout{n}.ckpt")
        with pytest.raises(ValueError, match=r"ranks \[1\] hold objects whose structure, storage sizes or views"):
            pf.save(obj, path)
        dist.barrier()
        if rank == 0:
            assert not os.path.exists(path) or os.path.getsize(path) == 0, n  # nothing written
    # The same layout on both ranks is written, and is what torch.save writes.
    pf.save(_layouts(0)[0], os.path.join(folder, "same.ckpt"))


def test_ranks_whose_views_into_their_storages_differ_are_refused_before_writing(tmp_path: Path) -> None:
    run_distributed(_refuse_other_layouts, 2, str(tmp_path))
    (tmp_path / "ref").mkdir()
    torch.save(_layouts(0)[0], tmp_path / "ref" / "same.ckpt")
    assert (tmp_path / "same.ckpt").read_bytes() == (tmp_path / "ref" / "same.ckpt").read_bytes()


# -- The save through the checkpointer ------------------------------------------------------------------------------------


def _save_in_shares(rank: int, world_size: int, folder: str) -> None:
    checkpointer = AsyncCheckpointer(storage=FileStorage())
    storage = checkpointer._storage
    out = Path(folder)
    try:
        for step in (1, 2):
            state = _state(step)
            path = out / f"step={step}.ckpt"
            rank_state = {"rng": torch.arange(4) + rank}
            checkpointer.save(path, state, rank_state=rank_state, metadata={"step": step})
            capture = checkpointer._previous[1]
            staged = capture.nbytes
            # Lightning's save_last=True: the state is unchanged, so `last` is written again from the same capture
            # (each rank compares its own staged range; the caller agrees across ranks).
            assert checkpointer.matches_last_save(state, rank_state=rank_state) == path
            last = out / f"last-{step}.ckpt"
            assert checkpointer.save_again(last, state, rank_state=rank_state, metadata={"step": step})
            # The training loop goes on at once: in place, through .data, and by a new tensor in the dict.
            for value in state["state_dict"].values():
                value.data.add_(1)
            state["optimizer_states"][0]["state"][0]["exp_avg"].mul_(-1)
            state["state_dict"]["big"] = torch.zeros(BIG)
            assert checkpointer.matches_last_save(state, rank_state=rank_state) is None
            checkpointer.wait()
            result = storage.last_result
            (out / f"rank{rank}-step{step}.json").write_text(
                json.dumps({"staged": staged, "storage_bytes": result.storage_bytes, "file_bytes": result.file_bytes})
            )
    finally:
        checkpointer.close()


def test_each_rank_stages_and_writes_about_half_and_the_file_is_the_state_at_the_save_call(tmp_path: Path) -> None:
    run_distributed(_save_in_shares, 2, str(tmp_path))
    total = _tensor_bytes(_state(1))
    for step in (1, 2):
        path = tmp_path / f"step={step}.ckpt"
        assert is_checkpoint_file(path) and zipfile.ZipFile(path).testzip() is None
        # torch.load in the plain way reads the state as it was at the save call (the mutations after it are absent).
        loaded = torch.load(path, weights_only=True)
        _equal(_state(step), {k: v for k, v in loaded.items() if k != RECORD_KEY})
        again = torch.load(tmp_path / f"last-{step}.ckpt", weights_only=True)
        _equal(_state(step), {k: v for k, v in again.items() if k != RECORD_KEY})
        # lightning-ft's record holds the crc32s the ranks' writes gave: the file loads as unedited.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, rank_state, _, edited = load_file(path, rank=1)
        assert not edited
        assert torch.equal(rank_state["rng"], torch.arange(4) + 1)
        reports = [json.loads((tmp_path / f"rank{r}-step{step}.json").read_text()) for r in (0, 1)]
        for report in reports:
            # Staged: about half of the replicated tensor bytes (+ the rank state, a page at a cut, a transposed
            # tensor staged whole); written: about half.
            assert 0.4 * total < report["staged"] < 0.6 * total, (report, total)
            assert 0.4 * total < report["storage_bytes"] < 0.6 * total, (report, total)
        assert reports[0]["staged"] + reports[1]["staged"] < 1.1 * total
    assert sorted(c.step for c in list_committed(tmp_path)) == [1, 1, 2, 2]


def _save_diverged(rank: int, world_size: int, folder: str, where: str) -> None:
    checkpointer = AsyncCheckpointer(storage=FileStorage())
    state = _state(1)
    if rank == 1:  # one rank's replica of one parameter has drifted (a parameter DDP does not synchronize)
        if where == "big":
            state["state_dict"]["big"].add_(1e-3)
        else:
            state["state_dict"]["small"][2] += 1
    path = Path(folder) / "step=1.ckpt"
    checkpointer.save(path, state, metadata={"step": 1})
    state["state_dict"][where].add_(7.0)  # after the save call: not in the file, on either rank
    checkpointer.close()


@pytest.mark.parametrize("where", ["big", "small"])
def test_a_rank_whose_replica_diverged_gets_rank_zeros_copy_in_the_file_as_ddp_strategy_writes(
    tmp_path, where, caplog
) -> None:
    # DDPStrategy's checkpoint holds rank 0's replica; so does the file, in every byte (the cut between the ranks lies
    # inside "big": rank 1's range must hold rank 0's bytes too), and the save does not fail.
    run_distributed(_save_diverged, 2, str(tmp_path), where)
    assert [c.step for c in list_committed(tmp_path)] == [1]
    loaded = torch.load(tmp_path / "step=1.ckpt", map_location="cpu", weights_only=True)
    expected = _state(1)
    for key, value in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value), key
    assert torch.equal(
        loaded["optimizer_states"][0]["state"][0]["exp_avg"], expected["optimizer_states"][0]["state"][0]["exp_avg"]
    )
