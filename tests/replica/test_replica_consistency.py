"""The consistency matrix with replica groups on (tests/strategy/test_consistency_matrix.py): every committed
checkpoint is the state at its save call, whatever user code writes right after it, when the fit is a replica group
(its steps pass the quorum and the commit vote; the group writes the checkpoints). One group: what the mode adds to a
save (the step gate, the writer's choice) is the same with one group as with several, and a second group would only
make each case slower; the hooks of every part of the save window are run (the matrix's DCP cases)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from tests.replica._lighthouse import lighthouse
from tests.strategy import consistency
from tests.strategy.consistency import kinds_for
from tests.strategy.test_consistency_matrix import DCP_CASES

pytest.importorskip("torchft")


@pytest.mark.slow
@pytest.mark.parametrize(("where", "hook"), DCP_CASES, ids=[f"{w}.{h}" for w, h in DCP_CASES])
def test_a_write_after_the_save_never_reaches_the_committed_checkpoint_of_a_replica_group(tmp_path, where, hook):
    import torch.distributed as dist

    from lightning_ft import ReplicaGroups

    env = dict(os.environ)
    try:
        with lighthouse() as address:
            groups = ReplicaGroups(
                lighthouse=address, replica_id="0", address="127.0.0.1", timeout=timedelta(seconds=5), num_groups=1
            )
            compared, problems, applied = consistency.run(
                tmp_path, hook=hook, where=where, checkpoint_format="torchsnapshot", replica_groups=groups, devices=1
            )
    finally:  # in a pytest process, the group's data-parallel process group (as DDPStrategy's) stays up after fit
        if dist.is_initialized():
            dist.destroy_process_group()
        for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            if key not in env:
                os.environ.pop(key, None)
    assert {kind for _, kind in applied} == set(kinds_for(hook)), "the matrix did not apply every kind of write"
    assert compared >= 15, "fewer saves than the matrix needs"
    assert not problems, f"{where}.{hook}: " + "; ".join(problems[:10])
