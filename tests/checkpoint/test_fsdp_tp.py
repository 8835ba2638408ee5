"""FSDP2 over tensor parallel (Lightning's tensor_parallel example layout) saves and restores bitwise.

``fully_shard`` over ``parallelize_module`` on a 2x2 mesh gives ``_StridedShard`` placements, which torchsnapshot itself
refuses; the checkpoint stores each owned local shard as a plain tensor with its global offset instead.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_ft._compat import DTensor
from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint
from tests.helpers import run_distributed

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard


class FeedForward(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def build(seed: int):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = FeedForward()
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
    parallelize_module(model, mesh["tensor_parallel"], plan)
    fully_shard(model, mesh=mesh["data_parallel"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_step(model, optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_tensors(tree) -> dict[str, torch.Tensor]:
    out = {}

    def walk(obj, path):
        if isinstance(obj, DTensor):
            out[path] = obj.full_tensor().clone()
        elif isinstance(obj, torch.Tensor):
            out[path] = obj.clone()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")

    walk(tree, "")
    return out


def _fsdp_tp_round_trip(rank: int, world_size: int, root: str) -> None:
    model, optimizer = build(seed=0)
    train_step(model, optimizer, seed=1)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    placements = {type(p).__name__ for v in state["model"].values() for p in v.placements}
    assert "_StridedShard" in placements, placements  # the layout torchsnapshot refuses
    expected = full_tensors(state)

    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(Path(root) / "step=1", state, metadata={"step": 1})
        train_step(model, optimizer, seed=2)  # mutates parameters and optimizer state in place
        checkpointer.wait()
    finally:
        checkpointer.close()

    fresh_model, fresh_optimizer = build(seed=123)
    train_step(fresh_model, fresh_optimizer, seed=3)  # so the optimizer has state tensors to fill
    template = {
        "model": get_model_state_dict(fresh_model),
        "optim": get_optimizer_state_dict(fresh_model, fresh_optimizer),
    }
    loaded = load_checkpoint(Path(root) / "step=1", template)
    set_model_state_dict(fresh_model, loaded.state["model"])
    set_optimizer_state_dict(fresh_model, fresh_optimizer, loaded.state["optim"])
    restored = {
        "model": get_model_state_dict(fresh_model),
        "optim": get_optimizer_state_dict(fresh_model, fresh_optimizer),
    }
    got = full_tensors(restored)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key

    # The stored offsets are the true global layout: assembling the shards without a template gives the full tensors.
    assembled = full_tensors(load_checkpoint(Path(root) / "step=1").state)
    for key, value in expected.items():
        assert torch.equal(assembled[key], value), key

    # And training continues identically from the restored state.
    train_step(model, optimizer, seed=4)
    train_step(fresh_model, fresh_optimizer, seed=2)
    train_step(fresh_model, fresh_optimizer, seed=4)
    after_resume = full_tensors(get_model_state_dict(fresh_model))
    uninterrupted = full_tensors(get_model_state_dict(model))
    for key, value in uninterrupted.items():
        assert torch.equal(after_resume[key], value), key


def test_fsdp2_over_tensor_parallel_saves_and_restores_model_and_optimizer_bitwise(tmp_path):
    run_distributed(_fsdp_tp_round_trip, 4, str(tmp_path))
