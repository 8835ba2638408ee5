"""Two gloo processes: the ranks agree on a signal at the same step, and the health report is the same everywhere."""

from __future__ import annotations

import os
import signal
import time
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
    import torch.distributed as dist

    signals = PreemptionSignals((signal.SIGUSR1,))
    signals.register()
    try:
        agreement = StopAgreement(signals, budget_s=0.05, max_interval=4)
        stopped_at = None
        for boundary in range(1, 60):
            time.sleep(0.002 if rank == 0 else 0.004)  # the ranks' step times differ: the schedule must not
            if rank == 1 and boundary == 7:
                os.kill(os.getpid(), signal.SIGUSR1)  # arrives at rank 1 only
            if agreement.poll() is not None:
                stopped_at = boundary
                break
        both: list = [None, None]
        dist.all_gather_object(both, (stopped_at, agreement.interval))
        assert both[0] == both[1], both  # the same boundary and the same schedule on every rank
        assert stopped_at is not None and 7 <= stopped_at <= 7 + 2 * 4, stopped_at  # within two checks
        assert agreement.decision.signal_ranks == (1,) and agreement.decision.signum == signal.SIGUSR1
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
