"""AsyncCheckpointer across gloo ranks: consistency, replicas written once, rank state, failures on one rank, resharding."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_ft._compat import Replicate, Shard
from lightning_ft.checkpoint import AsyncCheckpointer, CheckpointWriteError, load_checkpoint, verify
from lightning_ft.checkpoint import snapshot_storage as storage_module
from lightning_ft.checkpoint.internal import METADATA_FILE, is_committed, storage_named
from tests.helpers import run_distributed

try:
    from torch.distributed.tensor import distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import distribute_tensor


def reference_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "plain_a": torch.randn(64, 8, generator=generator),
        "plain_b": torch.randn(32, generator=generator),
        "plain_c": torch.randn(16, 4, generator=generator),
        "sharded": torch.randn(7, 6, generator=generator),  # 7 rows: uneven shards on 2 and 4 ranks
        "replicated": torch.randn(5, 3, generator=generator),
    }


def make_state(mesh) -> dict:
    ref = reference_tensors()
    return {
        "model": {"a": ref["plain_a"].clone(), "b": ref["plain_b"].clone(), "c": ref["plain_c"].clone()},
        "sharded": distribute_tensor(ref["sharded"].clone(), mesh, [Shard(0)]),
        "replicated": distribute_tensor(ref["replicated"].clone(), mesh, [Replicate()]),
        "hparams": {"lr": 0.1, "layers": (2, 3)},
    }


def full_disk(self, write_io):
    raise OSError(errno.ENOSPC, "No space left on device")


def _save_mutate_and_reload(rank: int, world_size: int, root: str) -> None:
    root_path = Path(root)
    mesh = init_device_mesh("cpu", (world_size,))
    state = make_state(mesh)
    rank_state = {
        "rank": rank,
        "generator": torch.Generator().manual_seed(rank).get_state(),
        "t": torch.full((3,), rank),
    }
    commits = []
    checkpointer = AsyncCheckpointer(on_commit=commits.append)
    try:
        checkpointer.save(root_path / "step=1", state, rank_state=rank_state, metadata={"step": 1, "mesh_shape": [2]})
        # The training loop moves on at once; none of this may reach the checkpoint.
        with torch.no_grad():
            state["model"]["a"].mul_(5)
            state["model"]["b"].zero_()
            state["sharded"].add_(100)
            state["replicated"].sub_(7)
        state["hparams"]["lr"] = 99.0
        checkpointer.wait()
    finally:
        checkpointer.close()
    assert commits == [] if rank else [c.path for c in commits] == [root_path / "step=1"]

    template = make_state(mesh)
    with torch.no_grad():
        for value in (*template["model"].values(), template["sharded"], template["replicated"]):
            value.zero_()
    loaded = load_checkpoint(root_path / "step=1", template)
    ref = reference_tensors()
    assert torch.equal(template["model"]["a"], ref["plain_a"])
    assert torch.equal(template["model"]["b"], ref["plain_b"])
    assert torch.equal(template["sharded"].full_tensor(), ref["sharded"])
    assert torch.equal(template["replicated"].to_local(), ref["replicated"])
    assert loaded.state["hparams"] == {"lr": 0.1, "layers": (2, 3)}
    assert loaded.saved_rank == rank and loaded.rank_state["rank"] == rank
    assert torch.equal(loaded.rank_state["t"], torch.full((3,), rank))
    assert loaded.metadata["world_size"] == world_size and loaded.metadata["step"] == 1

    if rank == 0:
        assert verify(root_path / "step=1") == []
        index = json.loads((root_path / "step=1" / METADATA_FILE).read_text())["tensors"]
        writers = set()
        for key, record in index.items():
            stored = sum(torch.Size(s["shape"]).numel() for s in record["shards"])
            assert stored == torch.Size(record["global_shape"]).numel(), f"{key} is not written exactly once"
            writers |= {s["rank"] for s in record["shards"]}
        assert writers == {0, 1}  # the replicas' bytes are spread over the ranks
        assert len(index["sharded"]["shards"]) == 2 and len(index["replicated"]["shards"]) == 1
        per_rank = {
            r: sum(s["nbytes"] for rec in index.values() for s in rec["shards"] if s["rank"] == r) for r in (0, 1)
        }
        assert all(n > 0 for n in per_rank.values())
    dist.barrier()

    # A full disk on rank 1 (inside torchsnapshot's collective write) fails the save on every rank, names the rank,
    # and leaves step=1 intact.
    if rank == 1:
        storage_module._DurableFSPlugin._write_sync = full_disk
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(root_path / "step=2", state, metadata={"step": 2})
        try:
            checkpointer.wait()
        except OSError as e:
            assert rank == 1 and e.errno == errno.ENOSPC
        except CheckpointWriteError as e:
            assert rank == 0 and "rank 1" in str(e) and "No space left" in str(e)
        else:
            raise AssertionError("the failed save was not reported")
    finally:
        checkpointer.close()
    assert not is_committed(root_path / "step=2")
    assert torch.equal(load_checkpoint(root_path / "step=1").state["model"]["a"], ref["plain_a"])


def test_two_ranks_save_consistently_write_replicas_once_and_restore_rank_state(tmp_path):
    run_distributed(_save_mutate_and_reload, 2, str(tmp_path))


def _save_sharded(rank: int, world_size: int, root: str, checkpoint_format: str = "torchsnapshot") -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    ref = reference_tensors()
    state = {
        "rows": distribute_tensor(ref["sharded"].clone(), mesh, [Shard(0)]),
        "cols": distribute_tensor(ref["plain_c"].clone(), mesh, [Shard(1)]),
    }
    checkpointer = AsyncCheckpointer(storage=storage_named(checkpoint_format))
    try:
        checkpointer.save(Path(root) / "c", state, rank_state={"rank": rank}, metadata={"step": 3})
    finally:
        checkpointer.close()


def _load_resharded(rank: int, world_size: int, root: str) -> None:
    ref = reference_tensors()
    if world_size == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        placements = {"rows": [Replicate(), Shard(0)], "cols": [Shard(0), Shard(1)]}
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        placements = {"rows": [Shard(0)], "cols": [Shard(1)]}
    template = {
        "rows": distribute_tensor(torch.zeros_like(ref["sharded"]), mesh, placements["rows"]),
        "cols": distribute_tensor(torch.zeros_like(ref["plain_c"]), mesh, placements["cols"]),
    }
    loaded = load_checkpoint(Path(root) / "c", template)
    assert torch.equal(template["rows"].full_tensor(), ref["sharded"])
    assert torch.equal(template["cols"].full_tensor(), ref["plain_c"])
    assert loaded.saved_rank == rank % 2 and loaded.rank_state == {"rank": rank % 2}


def test_dtensors_saved_on_two_ranks_load_into_one_rank_and_into_a_four_rank_2d_mesh(tmp_path):
    run_distributed(_save_sharded, 2, str(tmp_path))
    run_distributed(_load_resharded, 1, str(tmp_path))
    run_distributed(_load_resharded, 4, str(tmp_path))


def test_dtensors_saved_through_dcp_on_two_ranks_load_resharded_into_one_process(tmp_path):
    run_distributed(_save_sharded, 2, str(tmp_path), "dcp")
    path = tmp_path / "c"
    assert (path / ".metadata").is_file() and not (path / ".snapshot_metadata").exists()
    assert verify(path) == []
    ref = reference_tensors()
    template = {"rows": torch.zeros_like(ref["sharded"]), "cols": torch.zeros_like(ref["plain_c"])}
    loaded = load_checkpoint(path, template)  # no process group: one rank assembles both ranks' shards
    assert torch.equal(template["rows"], ref["sharded"]) and torch.equal(template["cols"], ref["plain_c"])
    assert loaded.saved_rank == 0 and loaded.rank_state == {"rank": 0} and loaded.metadata["world_size"] == 2


def _save_a_file_whose_replicas_differ(rank: int, world_size: int, root: str) -> None:
    from lightning_ft.checkpoint.single_file import FileStorage

    generator = torch.Generator().manual_seed(0)
    big, same = torch.randn(256, 1024, generator=generator), torch.randn(64, generator=generator)  # big: 1 MiB
    # A parameter DDP does not synchronize (unfrozen after wrapping, say): each rank holds its own values.
    state = {"state_dict": {"big": big + rank, "same": same}, "epoch": 0, "global_step": 3}
    checkpointer = AsyncCheckpointer(storage=FileStorage())
    try:
        metadata = {"step": 3, "full_state": True, "run_id": "r"}
        checkpointer.save(Path(root) / "c.ckpt", state, rank_state={"rank": rank}, metadata=metadata)
    finally:
        checkpointer.close()


def test_a_file_of_two_ranks_whose_replicas_differ_holds_rank_zeros_copy_as_ddp_strategy_writes(tmp_path):
    # DDPStrategy's checkpoint is rank 0's torch.save: every tensor as rank 0 holds it. The file both ranks write
    # holds the same, never a mix of the ranks' bytes (each rank writes about half of "big").
    run_distributed(_save_a_file_whose_replicas_differ, 2, str(tmp_path))
    path = tmp_path / "c.ckpt"
    generator = torch.Generator().manual_seed(0)
    big, same = torch.randn(256, 1024, generator=generator), torch.randn(64, generator=generator)
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["state_dict"]["big"], big) and torch.equal(saved["state_dict"]["same"], same)
    assert is_committed(path) and verify(path) == []  # its checksums are rank 0's bytes too
    assert torch.equal(load_checkpoint(path).state["state_dict"]["big"], big)
