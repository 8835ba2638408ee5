"""Exact resume on every rank: BatchNorm statistics, randomness in ``__getitem__`` and two combined loaders."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from lightning_ft.events import read_events
from tests.e2e._torchrun import assert_ok, torchrun

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("exactness_script.py")


def _load(out: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    state = torch.load(out / f"state_rank{rank}.pt", weights_only=True)
    return state, json.loads((out / f"losses_rank{rank}.json").read_text())


@pytest.mark.timeout(900)  # three torchrun runs, with DataLoader workers
@pytest.mark.parametrize(
    ("num_workers", "data_randomness", "replica"),
    [
        (0, "ddp", False),
        pytest.param(1, "per_sample", False, marks=pytest.mark.extended),
        # The killed and the resumed run as one replica group of the two processes (ElasticFT3D(replica_groups=...),
        # a lighthouse on 127.0.0.1), against the reference without replica groups.
        pytest.param(0, "ddp", True, id="0-ddp-replica-group"),
    ],
)
def test_every_rank_resumes_bitwise_with_batchnorm_data_randomness_and_two_loaders(
    tmp_path, num_workers, data_randomness, replica
):
    # Randomness drawn in DataLoader workers resumes exactly mid-epoch only with per-sample seeding.
    common = ["--num-workers", str(num_workers), "--max-steps", "14", "--ckpt-every", "4"]
    common += ["--data-randomness", data_randomness]
    ref = tmp_path / "ref"
    assert_ok(torchrun("--root", str(ref), "--out", str(ref / "out"), *common, script=SCRIPT))
    run = tmp_path / "run"
    args = ["--root", str(run), "--out", str(run / "out"), *common]
    with contextlib.ExitStack() as stack:
        env = None
        if replica:
            pytest.importorskip("torchft")
            from tests.replica._lighthouse import lighthouse

            address = stack.enter_context(lighthouse())
            env = {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "1"}
            args += ["--replica-groups", "1"]
        killed = torchrun(*args, "--kill-at-step", "9", script=SCRIPT, env=env)
        assert killed.returncode != 0, "the injected hard exit did not happen"
        assert_ok(torchrun(*args, script=SCRIPT, env=env))
    assert [e["step"] for e in read_events(run) if e["event"] == "resumed"] == [8]
    # With replica groups on, each attempt joined the lighthouse's quorum (the mode really ran).
    quorums = {e["attempt"] for e in read_events(run) if e["event"] == "replica_quorum"}
    assert sorted(quorums) == ([0, 1] if replica else []), quorums

    states = []
    for rank in (0, 1):
        state, losses = _load(run / "out", rank)
        ref_state, ref_losses = _load(ref / "out", rank)
        for step in range(9, 15):
            assert losses[str(step)] == ref_losses[str(step)], f"rank {rank}: loss at step {step} differs"
        for name, tensor in ref_state.items():
            assert torch.equal(state[name], tensor), f"rank {rank}: {name} differs after resume"
        states.append(state)
    # The ranks really hold different BatchNorm statistics: the test checks per-rank state, not a replica.
    assert not torch.equal(states[0]["net.1.running_mean"], states[1]["net.1.running_mean"])
