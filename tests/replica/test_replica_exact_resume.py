"""Exact resume with replica groups on (tests/e2e/test_exact_resume.py's run, tests/e2e/train_script.py): the fit as
one replica group of two processes, or as two replica groups of one process sharing one checkpoint folder, is killed
mid-epoch (every process exits hard at step 10, after the checkpoint of step 8 is committed) and started again with
the same command: it resumes from step 8 and ends bitwise equal to the uninterrupted run of two processes without
replica groups (Invariant 3: the mode trains what two data-parallel processes train)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lightning_ft.events import read_events
from tests.e2e._torchrun import assert_ok, load_run, torchrun
from tests.replica._lighthouse import lighthouse

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# As tests/e2e/test_exact_resume.py: 96 samples, 8 per replica, 2 replicas: 6 steps per epoch; step 8 is batch 2 of
# epoch 1, the kill at step 10 is mid-epoch.
COMMON = ["--max-steps", "14", "--dropout", "0.1", "--ckpt-every", "4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Two processes, no replica groups, no failure."""
    root = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(torchrun("--root", str(root), "--out", str(root / "out"), *COMMON, timeout=600))
    return load_run(root / "out")


def _groups(tmp: Path, address: str, layout: str, *extra: str) -> None:
    """Run the job (every group at once) to its end or its injected exit; assert each group's exit."""
    groups, nproc = (1, 2) if layout == "one-group-of-2" else (2, 1)

    def group(i: int):
        env = {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(i), "NUM_REPLICA_GROUPS": str(groups)}
        args = ["--root", str(tmp), "--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "out" / f"g{i}")]
        return torchrun(*args, *COMMON, "--replica-groups", str(groups), *extra, nproc=nproc, timeout=600, env=env)

    with ThreadPoolExecutor(groups) as pool:
        done = list(pool.map(group, range(groups)))
    for proc in done:
        if extra:
            assert proc.returncode != 0, "the injected hard exit did not happen"
        else:
            assert_ok(proc)


@pytest.mark.parametrize("layout", ["one-group-of-2", "two-groups-of-1"])
def test_a_killed_replica_job_resumed_with_the_same_command_matches_the_uninterrupted_run_bitwise(
    tmp_path: Path, reference: tuple[dict[str, torch.Tensor], dict[int, float]], layout: str
) -> None:
    with lighthouse(min_replicas=1 if layout == "one-group-of-2" else 2) as address:
        _groups(tmp_path, address, layout, "--kill-at-step", "10")
        _groups(tmp_path, address, layout)

    # Every group's rank 0 said it resumed from step 8 (the groups of one root: the root's log, or a run folder's).
    logs = [tmp_path, *(tmp_path / "lightning-ft" / "runs").glob("*")]
    resumed = [e for log in logs for e in read_events(log) if e["event"] == "resumed" and e["rank"] == 0]
    assert sorted(e["step"] for e in resumed) == [8] * (1 if layout == "one-group-of-2" else 2), resumed
    ref_weights, ref_losses = reference
    for out in sorted((tmp_path / "out").iterdir()):
        weights, losses = load_run(out)
        assert weights.keys() == ref_weights.keys()
        for name, tensor in ref_weights.items():
            assert torch.equal(weights[name], tensor), f"{out.name}: {name} differs after resume"
        if out.name == "g0":  # rank 0 of the job: the losses of its batches, step by step
            for step in range(9, 15):
                assert losses[step] == ref_losses[step], f"loss at step {step} differs"
