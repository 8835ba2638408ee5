"""A committed checkpoint is loadable: at commit, the shards must cover every tensor of the index; ``verify`` and
``lightning-ft inspect`` report the same problem for a checkpoint on disk."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from lightning_ft.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    list_committed,
    load_checkpoint,
    verify,
)
from lightning_ft.checkpoint.coverage import coverage_problems
from lightning_ft.checkpoint.internal import (
    COMMIT_MARKER,
    METADATA_FILE,
    describe,
    format_description,
    is_committed,
    storage_named,
)
from tests.checkpoint.support import folders_only, save
from tests.helpers import run_distributed

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


def _different_shapes_per_rank(rank: int, world_size: int, root: str, checkpoint_format: str) -> None:
    checkpointer = AsyncCheckpointer(storage=storage_named(checkpoint_format))
    try:
        # A contract breach: the shared state must hold the same tensors on every rank. Each rank then decides on
        # its own who writes what, and the decisions disagree: "a" is written twice, "b" by nobody.
        state = {"a": torch.zeros(4 if rank == 0 else 2), "b": torch.zeros(2 if rank == 0 else 4)}
        checkpointer.save(Path(root) / "c", state, metadata={"step": 1})
        with pytest.raises(CheckpointError) as raised:
            checkpointer.wait()
    finally:
        checkpointer.close()
    message = str(raised.value)
    assert "not committed" in message and "tensor 'a'" in message and "tensor 'b'" in message
    if rank == 1:
        assert isinstance(raised.value, CheckpointWriteError) and "rank 0" in message


def test_tensors_of_different_shapes_on_the_ranks_fail_the_save_instead_of_committing_a_checkpoint_that_cannot_load(
    tmp_path, checkpoint_format
):
    folders_only()
    # Two processes, in both formats: DCP plans and writes its own files collectively, before the check at commit.
    run_distributed(_different_shapes_per_rank, 2, str(tmp_path), checkpoint_format)
    assert not is_committed(tmp_path / "c")
    assert list_committed(tmp_path) == []


def _rewrite_index(path: Path, change) -> None:
    """Change the tensor index of a committed checkpoint and re-seal its marker, as a buggy writer would have."""
    document = json.loads((path / METADATA_FILE).read_text())
    change(document["tensors"])
    data = json.dumps(document).encode()
    (path / METADATA_FILE).write_bytes(data)
    marker = json.loads((path / COMMIT_MARKER).read_text())
    marker["metadata_crc32"] = zlib.crc32(data)
    (path / COMMIT_MARKER).write_text(json.dumps(marker))


def test_verify_and_inspect_report_a_committed_index_whose_shards_do_not_cover_a_tensor(tmp_path):
    folders_only()
    path = save(tmp_path / "c", 1, {"w": torch.ones(4), "b": torch.ones(3)})

    def grow_w(tensors):
        tensors["w"]["global_shape"] = [8]

    _rewrite_index(path, grow_w)
    problems = verify(path)
    assert any("tensor 'w'" in p and "cover 4 of its 8 elements" in p for p in problems), problems
    desc = describe(path)
    assert desc["coverage_ok"] is False and not desc["checksums_ok"]
    assert "coverage        INCOMPLETE" in format_description(desc)
    with pytest.raises(CorruptCheckpointError, match="cover 4 of its 8 elements"):
        load_checkpoint(path)


def _document(shards, global_shape, *, dtype="float32", rank_states=None, state=None):
    return {
        "metadata": {"world_size": len(rank_states) if rank_states is not None else 1},
        "state": state if state is not None else {"w": {"__lft__": "tensor", "key": "w"}},
        "rank_states": rank_states if rank_states is not None else [None],
        "tensors": {
            "w": {
                "dtype": dtype,
                "global_shape": global_shape,
                "shards": [
                    {"rank": r, "offset": o, "shape": s, "nbytes": 4 * torch.Size(s).numel()} for r, o, s in shards
                ],
            }
        },
    }


def test_coverage_accepts_exact_tilings_and_names_every_kind_of_gap_or_overlap():
    assert coverage_problems(_document([(0, [0, 0], [2, 4]), (1, [2, 0], [2, 4])], [4, 4])) == []
    assert coverage_problems(_document([(0, [0, 0], [4, 2]), (1, [0, 2], [4, 2])], [4, 4])) == []
    assert coverage_problems(_document([(0, [], [])], [])) == []  # a scalar
    assert coverage_problems(_document([], [0, 3])) == []  # an empty tensor has no shards

    [gap] = coverage_problems(_document([(0, [0, 0], [2, 4])], [4, 4]))
    assert "cover 8 of its 16 elements" in gap
    [overlap] = coverage_problems(_document([(0, [0, 0], [3, 4]), (1, [2, 0], [2, 4])], [4, 4]))
    assert "ranks 0 and 1 overlap" in overlap
    [outside] = coverage_problems(_document([(0, [0], [2]), (1, [0], [3])], [2]))
    assert "rank 1" in outside and "outside the tensor's global shape [2]" in outside and "rank_state" in outside
    [size] = coverage_problems(_document([(0, [0], [4])], [4], dtype="float64"))
    assert "holds 16 bytes, not the 32" in size

    missing = {"t": {"__lft__": "tensor", "key": "rank_state/1/t"}}
    problems = coverage_problems(_document([(0, [0], [4])], [4], rank_states=[None, missing]))
    assert problems == ["tensor 'rank_state/1/t' of rank 1's rank_state is missing from the index"]
    problems = coverage_problems(_document([(0, [0], [4])], [4], rank_states=[None]) | {"metadata": {"world_size": 2}})
    assert problems == ["the checkpoint holds the rank_state of 1 ranks; 2 wrote it"]
