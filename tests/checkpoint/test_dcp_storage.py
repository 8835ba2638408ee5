"""The DCP storage: a lightning-ft checkpoint whose data is an ordinary PyTorch distributed checkpoint."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_ft.checkpoint import AsyncCheckpointer, CorruptCheckpointError, load_checkpoint
from lightning_ft.checkpoint.dcp_folder import load_dcp
from lightning_ft.checkpoint.internal import EntryLayout
from lightning_ft.checkpoint.storage import DcpStorage
from tests.checkpoint.support import data_files
from tests.helpers import run_distributed

STATE = {
    "state_dict": {"net.weight": torch.randn(6, 4), "net.bias": torch.arange(4, dtype=torch.bfloat16)},
    "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
}


def _save(path: Path) -> Path:
    writer = AsyncCheckpointer(storage=DcpStorage())
    writer.save(path, STATE, metadata={"step": 7})
    writer.close()
    return path


def test_a_checkpoint_written_through_dcp_loads_back_without_any_unpickling(tmp_path, monkeypatch):
    path = _save(tmp_path / "ckpt")
    assert (path / ".metadata").is_file() and any(path.glob("*.distcp"))

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loaded = load_checkpoint(path, storage=DcpStorage())
    assert torch.equal(loaded.state["state_dict"]["net.weight"], STATE["state_dict"]["net.weight"])
    assert torch.equal(loaded.state["state_dict"]["net.bias"], STATE["state_dict"]["net.bias"])
    assert loaded.state["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1
    assert loaded.metadata["step"] == 7


def test_a_flipped_byte_in_a_dcp_file_fails_its_checksum_naming_the_tensor(tmp_path):
    path = _save(tmp_path / "ckpt")
    (data,) = [f for f in data_files(path) if f.suffix == ".distcp"]
    raw = bytearray(data.read_bytes())
    at = bytes(raw).find(STATE["state_dict"]["net.weight"].numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0xFF  # inside the weight's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in shard of tensor 'state_dict/net.weight'"):
        load_checkpoint(path, storage=DcpStorage())


FULL = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def _write_row_shards(rank, world_size, root):
    rows = FULL.chunk(world_size)[rank].clone()
    bias = torch.ones(4)
    entries = {"t0": rows.reshape(-1).view(torch.uint8)}
    layout = {"t0": EntryLayout("state_dict/net.weight", "float32", (6, 4), (3 * rank, 0), (3, 4))}
    if rank == 1:  # an unsharded tensor, written by one owner
        entries["t1"] = bias.view(torch.uint8)
        layout["t1"] = EntryLayout("state_dict/net.bias", "float32", (4,), (0,), (4,))
    DcpStorage().write(Path(root) / "ckpt", entries, group=None, layout=layout)
    dist.barrier()


def test_shards_of_two_ranks_form_an_ordinary_distributed_checkpoint_pytorch_tools_read(tmp_path):
    run_distributed(_write_row_shards, 2, str(tmp_path))
    path = tmp_path / "ckpt"
    dcp_to_torch_save(path, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert torch.equal(full["state_dict"]["net.weight"], FULL)
    assert torch.equal(full["state_dict"]["net.bias"], torch.ones(4))
    # DCP's loader reshards it too (into one full tensor here), as it would into another mesh.
    target = {"state_dict": {"net.weight": torch.zeros(6, 4)}}
    load_dcp(path, target)
    assert torch.equal(target["state_dict"]["net.weight"], FULL)
    # lightning-ft's own reader finds each rank's entry by (rank, entry).
    out = torch.empty(48, dtype=torch.uint8)
    DcpStorage().reader(path).read(1, "t0", out)
    assert torch.equal(out.view(torch.float32).reshape(3, 4), FULL[3:])
