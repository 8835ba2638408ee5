"""DTensor state as one checkpoint file of full tensors, written by every rank from its own shards.

Tensor parallel over 2 processes (gloo): an embedding and a column-parallel linear (``Shard(0)``, uneven: 7 and 5
rows over 2 ranks), a replicated layer norm (``Replicate``), Adam state of each. The file is what one process would
``torch.save`` for the same model (full tensors), read by plain ``torch.load`` in a process that never imported
lightning-ft; a resume at the same layout restores every local shard bitwise, each rank reading its own slice.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from lightning_ft._compat import DTensor, StridedShard
from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint
from lightning_ft.checkpoint.sharded_file import file_refusal, placement_is_contiguous
from lightning_ft.checkpoint.single_file import FileStorage
from tests.checkpoint.test_fsdp_tp import full_tensors
from tests.helpers import run_distributed


def build(seed: int, *, rowwise_linear: bool = False):
    torch.manual_seed(seed)
    # Tensor parallel over 2 ranks; with 4, two data-parallel replicas of it (each shard held by two ranks).
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    mesh = mesh["tensor_parallel"]
    model = nn.Sequential(nn.Embedding(7, 6), nn.Linear(6, 5), nn.LayerNorm(5))
    plan = {"0": RowwiseParallel(), "1": ColwiseParallel(), "2": SequenceParallel()}
    if rowwise_linear:
        plan["1"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(100 + step)
        for p in model.parameters():  # every parameter is a DTensor (SequenceParallel: Replicate)
            p.grad = distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements)
        optimizer.step()
    return model, optimizer


def lightning_dict(model, optimizer) -> dict:
    return {
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, optimizer)],
        "global_step": 2,
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _save_and_resume(rank: int, world_size: int, root: str) -> None:
    path = Path(root) / "epoch=0-step=2.ckpt"
    model, optimizer = build(0)
    checkpoint = lightning_dict(model, optimizer)
    placements = {name: t.placements for name, t in checkpoint["state_dict"].items() if isinstance(t, DTensor)}
    assert Shard(0) in placements["0.weight"] and Shard(0) in placements["1.weight"]
    assert placements["2.weight"] == (Replicate(),)
    expected = full_tensors(checkpoint)
    checkpointer = AsyncCheckpointer(storage=FileStorage())
    checkpointer.save(path, checkpoint, metadata={"step": 2})
    checkpointer.close()
    assert path.is_file(), "the checkpoint is one file at the path Lightning asked for"
    if rank == 0:
        torch.save(expected, Path(root) / "expected.pt")

    # Resume at the same layout: a model of other values, loaded in place; each rank reads its slice of the file.
    model2, optimizer2 = build(1)
    from lightning_ft._compat import init_optim_state

    init_optim_state(optimizer2)
    template = lightning_dict(model2, optimizer2)
    loaded = load_checkpoint(path, template)
    set_model_state_dict(model2, loaded.state["state_dict"])
    set_optimizer_state_dict(model2, optimizer2, loaded.state["optimizer_states"][0])
    for (name, a), (_, b) in zip(
        get_model_state_dict(model).items(), get_model_state_dict(model2).items(), strict=True
    ):
        assert isinstance(b, DTensor) and torch.equal(a.to_local(), b.to_local()), name
    ours = get_optimizer_state_dict(model, optimizer)["state"]
    theirs = get_optimizer_state_dict(model2, optimizer2)["state"]
    for name in ours:
        for key, value in ours[name].items():
            other = theirs[name][key]
            assert torch.equal(_local(value), _local(other)), (name, key)


def test_tensor_parallel_state_is_one_file_of_full_tensors_that_torch_load_reads_and_resumes_bitwise(tmp_path):
    run_distributed(_save_and_resume, 2, str(tmp_path))
    path = tmp_path / "epoch=0-step=2.ckpt"
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every record's CRC32 (combined from the ranks' pieces) holds
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    # A process that never imported lightning-ft reads it with torch.load(weights_only=True): full tensors.
    script = (
        "import sys, torch\n"
        f"d = torch.load({str(path)!r}, weights_only=True)\n"
        "assert 'lightning_ft' not in sys.modules\n"
        f"torch.save({{k: v for k, v in d['state_dict'].items()}}, {str(tmp_path / 'plain_sd.pt')!r})\n"
        f"torch.save(d['optimizer_states'], {str(tmp_path / 'plain_opt.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    state_dict = torch.load(tmp_path / "plain_sd.pt", weights_only=True)
    optimizer_states = torch.load(tmp_path / "plain_opt.pt", weights_only=True)
    assert set(state_dict) == {"0.weight", "1.weight", "1.bias", "2.weight", "2.bias"}
    for name, value in state_dict.items():
        assert type(value) is torch.Tensor and torch.equal(value, expected[f"/state_dict/{name}"]), name
    assert state_dict["0.weight"].shape == (7, 6) and state_dict["1.weight"].shape == (5, 6)
    for name, slots in optimizer_states[0]["state"].items():
        for key, value in slots.items():
            assert torch.equal(value, expected[f"/optimizer_states/0/state/{name}/{key}"]), (name, key)


def test_data_parallel_replicas_of_the_shards_write_each_byte_once_into_the_same_file(tmp_path):
    # 4 ranks: every region is held by two ranks (one per replica) and written by one of them; a byte written twice
    # or by nobody fails the save (the ranks' pieces must tile each tensor).
    run_distributed(_save_and_resume, 4, str(tmp_path))
    path = tmp_path / "epoch=0-step=2.ckpt"
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    state_dict = torch.load(path, weights_only=True)["state_dict"]
    for name, value in state_dict.items():
        assert torch.equal(value, expected[f"/state_dict/{name}"]), name


def test_which_placements_a_checkpoint_file_holds():
    assert placement_is_contiguous([Shard(0)], [7, 6])  # uneven rows: torch.chunk gives 4 and 3
    assert placement_is_contiguous([Replicate(), Shard(0)], [8, 4])  # data-parallel replicas of row shards
    assert placement_is_contiguous([Shard(0), Shard(0)], [8, 4])
    assert placement_is_contiguous([Replicate()], [])
    assert not placement_is_contiguous([Shard(1)], [6, 5])  # RowwiseParallel's Linear weight: a column block
    assert placement_is_contiguous([Shard(1)], [1, 5])  # one row: its column block is one byte range
    assert not placement_is_contiguous([Shard(-1)], [6, 5])
    assert not placement_is_contiguous([StridedShard(0, split_factor=2)], [8, 4])  # FSDP2 over tensor parallel
    assert not placement_is_contiguous([Partial()], [4])


def _refusal(rank: int, world_size: int) -> None:
    model, _ = build(0, rowwise_linear=True)
    reason = file_refusal(model.named_parameters())
    assert reason is not None and reason.startswith(
        "'1.weight' is a DTensor with placements (Shard(dim=1)) (shape [5, 6])"
    ), reason
    model, _ = build(0)
    assert file_refusal(model.named_parameters()) is None


def test_the_first_tensor_a_file_cannot_hold_is_named_with_its_placement():
    run_distributed(_refusal, 2)


def _shard1_save_fails(rank: int, world_size: int, root: str) -> None:
    from lightning_ft.checkpoint import CheckpointError

    model, optimizer = build(0, rowwise_linear=True)
    checkpointer = AsyncCheckpointer(storage=FileStorage())
    checkpointer.save(Path(root) / "x.ckpt", lightning_dict(model, optimizer), metadata={"step": 2})
    with pytest.raises(CheckpointError, match=r"tensor 'state_dict/1.weight'.*not a contiguous byte range"):
        checkpointer.close()
    if rank == 0:  # rank 0 removes what its failed save left (the placeholder), then fails
        assert not (Path(root) / "x.ckpt").exists() and not list(Path(root).iterdir())


def test_a_save_of_column_blocks_into_a_file_fails_naming_the_tensor_and_commits_nothing(tmp_path):
    run_distributed(_shard1_save_fails, 2, str(tmp_path))


def test_a_flipped_byte_in_a_shard_written_by_rank_1_is_refused_as_corrupt(tmp_path):
    from lightning_ft.checkpoint import CorruptCheckpointError

    run_distributed(_save_and_resume, 2, str(tmp_path))
    path = tmp_path / "epoch=0-step=2.ckpt"
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    # The last row of the embedding: rank 1's shard (7 rows: rows 4-6 are rank 1's), written by rank 1 alone.
    row = expected["/state_dict/0.weight"][6].numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(row)
    assert at > 0 and data.find(row, at + 1) < 0
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"fail\(s\) the zip's CRC32.*state_dict/0.weight"):
        load_checkpoint(path)


def _fsdp2(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    optimizer.step()
    checkpoint = lightning_dict(model, optimizer)
    assert all(t.placements == (Shard(0),) for t in checkpoint["state_dict"].values())
    expected = full_tensors(checkpoint)
    checkpointer = AsyncCheckpointer(storage=FileStorage())
    checkpointer.save(Path(root) / "fsdp.ckpt", checkpoint, metadata={"step": 1})
    checkpointer.close()
    saved = torch.load(Path(root) / "fsdp.ckpt", weights_only=True)
    for name, value in saved["state_dict"].items():
        assert torch.equal(value, expected[f"/state_dict/{name}"]), name
    for name, slots in saved["optimizer_states"][0]["state"].items():
        for key, value in slots.items():
            assert torch.equal(value, expected[f"/optimizer_states/0/state/{name}/{key}"]), (name, key)


def test_fsdp2_shards_are_rows_and_make_the_same_file(tmp_path):
    run_distributed(_fsdp2, 2, str(tmp_path))
