"""How the ranks agree to stop (fault/agreement.py): the first signal on any rank decides, every signalled rank is
listed, and the checks are spaced by the slowest rank's step time."""

from __future__ import annotations

import math
import signal

from lightning_ft.fault.agreement import StopAgreement, decide
from lightning_ft.fault.signals import PreemptionSignals


def test_the_first_signal_on_any_rank_decides_and_every_signalled_rank_is_listed():
    nan = math.nan
    assert decide([(nan, 0.0), (nan, 0.0)]) is None
    decision = decide([(nan, 0.0), (12.5, float(signal.SIGUSR1)), (11.0, float(signal.SIGTERM))])
    assert decision.signal_time == 11.0 and decision.signum == signal.SIGTERM
    assert decision.signal_ranks == (1, 2)


def test_on_one_process_the_agreement_is_the_local_flag():
    signals = PreemptionSignals((signal.SIGTERM,))
    agreement = StopAgreement(signals)
    assert agreement.poll() is None and agreement.now() is None
    signals.handle(signal.SIGTERM)
    decision = agreement.poll()
    assert decision is not None and decision.signal_ranks == (0,)
    agreement.close()


class TwoRanks:
    """A gather for one process that plays two ranks: rank 1's rows are scripted."""

    def __init__(self) -> None:
        self.started: list[tuple] = []
        self.peer = (math.nan, 0.0, 10.0)

    def __call__(self, row):
        self.started.append(row)
        rows = [tuple(row), self.peer]
        return lambda: rows


def test_checks_are_spaced_by_the_slowest_proposal_and_a_peer_flag_stops_within_two_checks():
    clock = [0.0]
    gather = TwoRanks()
    agreement = StopAgreement(
        PreemptionSignals((signal.SIGTERM,)), budget_s=1.0, max_interval=10, gather=gather, clock=lambda: clock[0]
    )

    def step(seconds: float) -> object:
        clock[0] += seconds
        return agreement.poll()

    for _ in range(3):
        assert step(0.25) is None  # first checks at every boundary, until a step time is known
    assert agreement.interval == 4  # this rank proposes 1 s / 0.25 s; the peer proposed 10: the smaller wins
    checks = len(gather.started)
    for _ in range(4):
        assert step(0.25) is None
    assert len(gather.started) == checks + 1  # one check in four boundaries
    gather.peer = (123.0, float(signal.SIGUSR1), 10.0)  # rank 1 receives SIGUSR1
    boundaries = 0
    while (decision := step(0.25)) is None:
        boundaries += 1
    assert boundaries < 2 * agreement.interval
    assert decision.signal_ranks == (1,) and decision.signal_time == 123.0 and decision.signum == signal.SIGUSR1
    assert step(0.25) is decision  # decided once, for good


def test_now_reads_the_pending_gather_and_one_more():
    gather = TwoRanks()
    agreement = StopAgreement(PreemptionSignals((signal.SIGTERM,)), gather=gather)
    assert agreement.poll() is None and len(gather.started) == 1
    assert agreement.now() is None and len(gather.started) == 2
    gather.peer = (5.0, float(signal.SIGTERM), 1.0)
    assert agreement.now().signal_ranks == (1,)
