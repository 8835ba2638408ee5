"""Sharded replica groups on CUDA, the groups joined across by torchft's ``ProcessGroupNCCL``, its
``ProcessGroupBabyNCCL`` (NCCL in a child process) or ``ProcessGroupGloo`` (CUDA tensors through host memory):
``ReplicaGroups(process_group=...)``. scripts/gpu_check.sh runs it on a machine with GPUs; without CUDA it is skipped
(tests/conftest.py), and this project's own machine has none, so these cases are **not verified here**.

The same run as the CPU case (tests/replica/test_replica_sharded_e2e.py, the FSDP2 model): one group SIGKILLed and
relaunched, the survivor never restarting, the groups bitwise one model per rank at every shared committed step and
at the end, the relaunched group healed rank by rank. NCCL cannot join two ranks on one GPU, so the layout follows
the GPUs visible: with 4 or more, 2 groups of 2 processes (FSDP2 over 2 GPUs in each group, each group on its own
GPUs); with 2 or 3, 2 groups of 1 process on a GPU each; with 1, the NCCL cases are skipped and the gloo case runs
2 groups of 1 process sharing it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.replica.test_replica_sharded_e2e import assert_one_model, run_groups

pytest.importorskip("torchft")

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("process_group", ["gloo", "nccl", "baby_nccl"])
def test_sharded_groups_on_cuda_survive_a_sigkilled_group_and_heal_it_bitwise(
    tmp_path: Path, process_group: str
) -> None:
    import torch

    count = torch.cuda.device_count()
    if process_group != "gloo" and count < 2:
        pytest.skip(f"process_group={process_group!r} needs a GPU per group (NCCL joins no two ranks on one GPU)")
    nproc = 2 if count >= 4 else 1

    def env(replica_id: str) -> dict[str, str]:
        if count < 2 * nproc:  # one GPU, shared by two one-process groups (gloo only)
            return {}
        first = int(replica_id) * nproc
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(first + i) for i in range(nproc))}

    extra = ("--accelerator", "cuda", "--process-group", process_group)
    runs = run_groups(tmp_path, "fsdp2", kill=True, nproc=nproc, extra=extra, env=env)
    healed = assert_one_model(runs, tmp_path)
    print(
        f"\nsharded groups on {count} GPU(s), {nproc} process(es) per group, across groups {process_group}:"
        f" relaunched group's first step {runs['g1b'][0][0]['step']}, heal {healed['bytes']} bytes in"
        f" {healed['seconds']:.3f} s"
    )
