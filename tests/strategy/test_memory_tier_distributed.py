"""The memory tier on 2 ranks as 2 simulated nodes (gloo, one memory folder each): every save keeps each rank's copy on
its own node and on its partner's; a rank whose node lost its memory, or whose own copy is damaged, restores bitwise
from the copy its partner keeps; two copies lost leave no memory step to agree on."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_ft.checkpoint.internal import MemoryTier, capture_own, list_copies
from lightning_ft.strategy.memory_checkpoints import MemoryCheckpoints, MemoryRestoreError, _Job
from tests.helpers import run_distributed


class _Log:
    run_id = "run-a"

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def write(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def _tier(rank: int, world_size: int, root: Path) -> MemoryCheckpoints:
    # One agent per node: each rank is local rank 0 of its own node, with its own memory folder.
    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", LIGHTNING_FT_MEMORY_DIR=str(root / f"node{rank}"))
    strategy = SimpleNamespace(
        global_rank=rank,
        world_size=world_size,
        num_processes=1,
        local_rank=0,
        event_log=_Log(),
        lightning_module=None,
        run_identity=lambda: None,
        optimizers=[],
        _mode=SimpleNamespace(name="data_parallel"),
        mesh_shape=lambda: {"pipeline_parallel": 1, "data_parallel": world_size, "tensor_parallel": 1},
    )
    memory = MemoryCheckpoints(MemoryTier(every_n_train_steps=2), strategy)
    memory.setup_tier(trainer=None)
    return memory


def _state(rank: int, step: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"state_dict": {"w": torch.randn(64, 8, generator=g)}, "global_step": step}, {"rng": {"seed": rank}}


def _save(memory: MemoryCheckpoints, rank: int, step: int) -> None:
    state, rank_state = _state(rank, step)
    metadata = {
        "step": step,
        "run_id": "run-a",
        "mesh": memory._strategy.mesh_shape(),
        "memory_rank": rank,
        "memory_world_size": memory.layout.world_size,
        "node_layout": memory.layout.describe(),
        "full_state": True,
    }
    job = _Job(step, capture_own(state, rank_state, memory._stager), metadata, 0.0, 0.0)
    memory._write(job)


def _restore_after(rank: int, world_size: int, root: str, damage: str) -> None:
    root = Path(root)
    memory = _tier(rank, world_size, root)
    try:
        for step in (2, 4):
            _save(memory, rank, step)
        copies = list_copies(memory.run_dir, local_rank=0, local_world_size=1)
        # Only the newest step is kept, once for itself and once for its partner.
        found = sorted((c.rank, c.step, c.peer) for c in copies)
        assert found == sorted([(rank, 4, False), (1 - rank, 4, True)]), (found, memory._strategy.event_log.lines)
        dist.barrier()
        if rank == 1 and damage in ("node_lost", "both_lost", "vanished"):
            shutil.rmtree(memory.run_dir)  # its RAM is gone: a new node joins with nothing
        if rank == 0 and damage == "both_lost":
            shutil.rmtree(memory.run_dir / "peer-of-rank1")
        if rank == 1 and damage == "flipped":
            shard = max((memory.run_dir / "rank1" / "step=4" / "shards").iterdir(), key=lambda p: p.stat().st_size)
            data = bytearray(shard.read_bytes())
            data[5] ^= 0xFF
            shard.write_bytes(bytes(data))
        dist.barrier()
        path = memory.plan(durable_step=2)
        if damage == "vanished":
            # The partner's copy disappears between the plan and the restore: every rank fails the restore alike, so
            # that all fall back to the durable tier together.
            if rank == 0:
                shutil.rmtree(memory.run_dir / "peer-of-rank1")
            with pytest.raises(MemoryRestoreError, match="rank 1") as raised:
                memory.load(None)
            assert raised.value.tier == "peer"
            return
        if damage == "both_lost":
            assert path is None  # nobody holds rank 1's step 4: the durable tier is used
            return
        assert path is not None
        loaded, plan = memory.load(None)
        assert plan.step == 4 and plan.restored_from == {"local": 1, "peer": 1, "durable": 0}
        expected, expected_rank_state = _state(rank, 4)
        assert torch.equal(loaded.state["state_dict"]["w"], expected["state_dict"]["w"])
        assert loaded.rank_state == expected_rank_state and loaded.metadata["world_size"] == world_size
        if rank == 0:
            rejected = [f for e, f in memory._strategy.event_log.lines if e == "checkpoint_rejected"]
            assert [r["tier"] for r in rejected] == (["local"] if damage == "flipped" else [])
        # The restored rank keeps what it received as its own copy on its (new) node.
        assert (memory.run_dir / f"rank{rank}" / "step=4" / "lightning_ft.committed").is_file()
    finally:
        memory.close(finished=False)


def test_a_rank_whose_node_lost_its_memory_restores_from_its_partner_s_copy(tmp_path):
    run_distributed(_restore_after, 2, str(tmp_path), "node_lost")


def test_a_rank_whose_own_copy_fails_its_checksum_restores_from_its_partner_s_copy(tmp_path):
    run_distributed(_restore_after, 2, str(tmp_path), "flipped")


def test_when_both_copies_of_a_rank_are_lost_no_memory_step_is_agreed(tmp_path):
    run_distributed(_restore_after, 2, str(tmp_path), "both_lost")


def test_a_partner_copy_that_vanishes_before_the_restore_fails_it_on_every_rank(tmp_path):
    run_distributed(_restore_after, 2, str(tmp_path), "vanished")
