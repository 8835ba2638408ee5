"""The memory tier's copies with replica groups: each group keeps its own (the folder is keyed by the replica id, and
every copy records it), so a copy of another group found in a group's folder is refused at resume."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_ft.checkpoint.internal import MemoryTier, capture_own, list_copies
from lightning_ft.strategy.memory_checkpoints import MemoryCheckpoints, _Job, memory_run_name


class _Log:
    run_id = "job"

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def write(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def _strategy(replica_id: str | None) -> SimpleNamespace:
    return SimpleNamespace(
        global_rank=0,
        world_size=1,
        num_processes=1,
        local_rank=0,
        event_log=_Log(),
        lightning_module=None,
        run_identity=lambda: None,
        optimizers=[],
        _mode=SimpleNamespace(name="data_parallel"),
        mesh_shape=lambda: {"pipeline_parallel": 1, "data_parallel": 1, "tensor_parallel": 1},
        _replica_config=None if replica_id is None else SimpleNamespace(replica_id=replica_id),
    )


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str | None], MemoryCheckpoints]]:
    """Opens the memory tier of a group (its replica id) on one node's memory folder, shared by the groups; closes
    every one it opened."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LIGHTNING_FT_MEMORY_DIR", str(tmp_path / "shm"))
    opened: list[MemoryCheckpoints] = []

    def open_tier(replica_id: str | None) -> MemoryCheckpoints:
        memory = MemoryCheckpoints(MemoryTier(every_n_train_steps=2), _strategy(replica_id))
        memory.setup_tier(trainer=None)
        opened.append(memory)
        return memory

    yield open_tier
    for memory in opened:
        memory.close(finished=False)


def _save(memory: MemoryCheckpoints, step: int) -> Path:
    state = {"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}
    metadata = {"step": step, "full_state": True, "memory_rank": 0, **memory._expected()}
    memory._write(_Job(step, capture_own(state, {"rng": {}}, memory._stager), metadata, 0.0, 0.0))
    [copy] = list_copies(memory.run_dir, local_rank=0, local_world_size=1)
    return copy.path


def test_each_replica_group_has_its_own_memory_folder(tier) -> None:
    names = {rid: memory_run_name(None, _strategy(rid)) for rid in (None, "0", "1")}
    assert len(set(names.values())) == 3, names
    assert all(name.startswith("job-") for name in names.values())
    g0, g1 = tier("0"), tier("1")
    assert g0.run_dir != g1.run_dir and g0.run_dir.parent == g1.run_dir.parent
    # Both groups save the same step on one node: neither removes nor replaces the other's copy.
    p0, p1 = _save(g0, 4), _save(g1, 4)
    assert p0.is_dir() and p1.is_dir() and p0 != p1
    assert g0.plan(None) == str(p0) and g1.plan(None) == str(p1)


def test_a_copy_of_another_replica_group_is_refused(tier) -> None:
    g1 = tier("1")
    theirs = _save(g1, 6)
    g0 = tier("0")
    mine = g0.run_dir / theirs.relative_to(g1.run_dir)
    mine.parent.mkdir(parents=True)
    shutil.copytree(theirs, mine)  # group 1's copy in group 0's folder (moved there by hand, say)
    assert g0.plan(None) is None  # refused: the durable tier is used
    [(event, fields)] = [line for line in g0._strategy.event_log.lines if line[0] == "checkpoint_rejected"]
    assert "replica_id '1' differs from this run's '0'" in fields["reason"], fields
    assert mine.is_dir()  # left where it is
