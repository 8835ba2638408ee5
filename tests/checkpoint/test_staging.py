"""The capture: JSON now, copies of exactly what this rank writes, reusable buffers; each rank stages only its share."""

from __future__ import annotations

import gc
import json
import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_ft._compat import Replicate, Shard
from lightning_ft.checkpoint import AsyncCheckpointer, json_codec
from lightning_ft.checkpoint.internal import METADATA_FILE
from lightning_ft.checkpoint.ownership import regions_to_write
from lightning_ft.checkpoint.staging import Stager, encode_state
from tests.helpers import run_distributed

try:
    from torch.distributed.tensor import distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import distribute_tensor


def capture_all(stager: Stager, state, rank_state=None, *, rank: int = 0):
    encoded = encode_state(state, rank_state, rank=rank)
    return stager.capture(encoded, regions_to_write(encoded.shared, rank=0, world_size=1, group=None))


def test_a_capture_holds_copies_so_later_changes_to_tensors_and_containers_do_not_reach_it():
    weight = torch.arange(6.0)
    state = {"model": {"weight": weight}, "loops": {"epoch": 1, "seen": [1, 2]}}
    capture = capture_all(Stager(), state)
    weight.mul_(10)
    state["loops"]["epoch"] = 99
    state["loops"]["seen"].append(3)
    [shard] = capture.shards
    assert torch.equal(shard.data, torch.arange(6.0)) and shard.key == "model/weight"
    decoded = json_codec.decode(capture.state_json, lambda key, path: f"<tensor {key}>")
    assert decoded == {"model": {"weight": "<tensor model/weight>"}, "loops": {"epoch": 1, "seen": [1, 2]}}


def test_only_the_given_regions_and_every_per_rank_tensor_are_staged():
    state = {"a": torch.ones(100), "b": torch.ones(60), "c": torch.ones(50, dtype=torch.float64)}
    rank_state = {"rng": torch.zeros(8, dtype=torch.uint8)}
    encoded = encode_state(state, rank_state, rank=1)
    writes = regions_to_write(encoded.shared, rank=1, world_size=2, group=None)
    capture = Stager().capture(encoded, writes)
    assert sorted(s.key for s in capture.shards) == ["c", "rank_state/1/rng"]
    assert capture.nbytes == 50 * 8 + 8
    assert set(capture.tensors) == {"a", "b", "c", "rank_state/1/rng"}  # every record, written or not


def test_an_empty_tensor_is_recorded_but_not_staged():
    capture = capture_all(Stager(), {"empty": torch.zeros(0, 3), "w": torch.ones(2)})
    assert [s.key for s in capture.shards] == ["w"]
    assert capture.tensors["empty"]["global_shape"] == [0, 3]


def test_buffers_are_reused_between_saves_and_released_when_this_rank_stops_writing_a_tensor():
    stager = Stager()
    state = {"a": torch.ones(16), "b": torch.ones(8)}
    first = {s.key: s.data for s in capture_all(stager, state).shards}
    second = {s.key: s.data for s in capture_all(stager, state).shards}
    assert all(first[k].data_ptr() == second[k].data_ptr() for k in ("a", "b"))

    released = weakref.ref(first["b"])
    del first, second
    capture_all(stager, {"a": torch.ones(16)})
    gc.collect()
    assert released() is None, "the staging buffer of a tensor this rank no longer writes is still held"


def test_without_reuse_every_capture_gets_fresh_buffers():
    stager = Stager(reuse_buffers=False)
    state = {"a": torch.ones(16)}
    first, second = capture_all(stager, state), capture_all(stager, state)
    assert first.shards[0].data.data_ptr() != second.shards[0].data.data_ptr()


def _staged_bytes_per_save(rank: int, world_size: int, root: str) -> None:
    # One mesh (data_parallel=1, tensor_parallel=2): on it, a replicated DTensor, a sharded one, and a DTensor on the
    # size-1 data-parallel slice, whose twin on the other rank its placements cannot see.
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    generator = torch.Generator().manual_seed(0)
    dtensor_state = {
        "replicated": distribute_tensor(
            torch.randn(64, 8, generator=generator), mesh["tensor_parallel"], [Replicate()]
        ),
        "sharded": distribute_tensor(torch.randn(10, 4, generator=generator), mesh["tensor_parallel"], [Shard(0)]),
        "twin": distribute_tensor(torch.randn(6, 4, generator=generator), mesh["data_parallel"], [Shard(0)]),
        "plain": torch.randn(32, generator=generator),
    }
    plain_state = {"a": torch.randn(64, 8, generator=generator), "b": torch.randn(32, generator=generator)}

    staged: list[int] = []
    exchanges_in_save: list[str] = []
    original_capture, original_all_gather = Stager.capture, dist.all_gather_object

    def spying_capture(self, *args, **kwargs):
        capture = original_capture(self, *args, **kwargs)
        staged.append(sum(s.data.numel() * s.data.element_size() for s in capture.shards))
        return capture

    def counting_all_gather(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            exchanges_in_save.append("all_gather_object")
        return original_all_gather(*args, **kwargs)

    Stager.capture = spying_capture
    dist.all_gather_object = counting_all_gather
    try:
        checkpointer = AsyncCheckpointer()
        try:
            checkpointer.save(Path(root) / "plain", plain_state)
            checkpointer.wait()
            plain_exchanges = len(exchanges_in_save)
            checkpointer.save(Path(root) / "dtensor", dtensor_state)
            checkpointer.wait()
            dtensor_exchanges = len(exchanges_in_save) - plain_exchanges
        finally:
            checkpointer.close()
    finally:
        Stager.capture, dist.all_gather_object = original_capture, original_all_gather

    assert plain_exchanges == 0, "a plain (data-parallel) state paid a collective in save()"
    assert dtensor_exchanges == 1
    everyone: list[list[int]] = [[] for _ in range(world_size)]
    dist.all_gather_object(everyone, staged)
    for n, name in enumerate(("plain", "dtensor")):
        index = json.loads((Path(root) / name / METADATA_FILE).read_text())["tensors"]
        written = [sum(s["nbytes"] for rec in index.values() for s in rec["shards"] if s["rank"] == r) for r in (0, 1)]
        assert [everyone[r][n] for r in (0, 1)] == written, f"{name}: staged {everyone}, written {written}"
        total = sum(4 * torch.Size(rec["global_shape"]).numel() for rec in index.values())
        assert sum(written) == total, f"{name}: {written} bytes written for {total} bytes of tensors"
        assert all(0 < w < total for w in written)
    dist.barrier()


def test_each_rank_stages_only_what_it_writes_and_plain_state_needs_no_exchange(tmp_path):
    run_distributed(_staged_bytes_per_save, 2, str(tmp_path))
