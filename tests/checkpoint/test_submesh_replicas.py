"""A DTensor on a mesh that is a slice of the world has twins its placements cannot see: each is written once."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint
from lightning_ft.checkpoint.internal import METADATA_FILE
from tests.helpers import run_distributed


def _save_and_load(rank: int, world_size: int, root: str) -> None:
    # A (data_parallel=1, tensor_parallel=2) mesh: FSDP over the size-1 data-parallel slice gives every rank a full,
    # identical copy of a parameter that tensor parallelism does not shard (an embedding, a norm).
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    param = distribute_tensor(full.clone(), mesh["data_parallel"], [Shard(0)])
    ckpt = AsyncCheckpointer()
    path = Path(root) / "ckpt"
    ckpt.save(path, {"w": param}, metadata={"step": 1})
    ckpt.close()
    dist.barrier()
    index = json.loads((path / METADATA_FILE).read_text())["tensors"]
    shards = index["w"]["shards"]
    assert len(shards) == 1, f"written {len(shards)} times: {shards}"
    target = distribute_tensor(torch.zeros(6, 4), mesh["data_parallel"], [Shard(0)])
    load_checkpoint(path, {"w": target})
    assert torch.equal(target.to_local(), full)


def test_identical_shards_on_disjoint_sub_meshes_are_written_once_and_load_everywhere(tmp_path):
    run_distributed(_save_and_load, 2, str(tmp_path))
