"""Two gloo processes: the ranks agree on a signal at the same step, and the health report is the same everywhere."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from lightning_ft.fault.agreement import StopAgreement
from lightning_ft.fault.health import check_checkpoint_dirs, check_collective, exchange, raise_if_failed
from lightning_ft.fault.signals import PreemptionSignals
from tests.helpers import run_distributed


def _writable(dirpath: Path) -> None:
    if str(dirpath).startswith("/sys"):
        raise ValueError(f"ModelCheckpoint(dirpath={str(dirpath)!r}): cannot write into '/sys' (Permission denied)")


def _agree_and_check(rank: int, world_size: int, tmp: str) -> None:
    signals = PreemptionSignals((signal.SIGUSR1,))
    signals.register()
    try:
        agreement = StopAgreement(signals)
        decisions = []
        for step in range(10):
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)  # arrives at rank 1 only, before its step-3 boundary
            decisions.append(agreement.poll())
            if decisions[-1] is not None:
                break
        # Pipelined: the gather started at boundary 3 carries the flag and is read at boundary 4, on both ranks.
        assert len(decisions) == 5 and decisions[:4] == [None] * 4, decisions
        assert decisions[-1].signal_ranks == (1,) and decisions[-1].signum == signal.SIGUSR1
        agreement.close()
    finally:
        signals.uninstall()

    quiet = StopAgreement(PreemptionSignals((signal.SIGUSR1,)))
    assert quiet.poll() is None and quiet.now() is None  # now() reads the pending gather, then one more
    quiet.close()

    dirpath = Path("/sys/lightning_ft_ckpt") if rank == 1 else Path(tmp)
    failures = check_checkpoint_dirs(rank, [dirpath], checkpoint_bytes=1, keep=lambda d: 1, check_dir=_writable)
    failures, _ = exchange(failures, {"rank": rank})
    with pytest.raises(ValueError) as raised:
        raise_if_failed(failures, world_size)
    assert "1 of 2 rank(s) [1]" in str(raised.value) and "rank 1 checkpoint_dir" in str(raised.value)

    bad, busbw = check_collective(rank, world_size, torch.device("cpu"))
    assert bad == [] and busbw is not None and busbw > 0


def test_two_ranks_stop_at_the_same_step_and_share_one_health_report(tmp_path):
    run_distributed(_agree_and_check, 2, str(tmp_path))
