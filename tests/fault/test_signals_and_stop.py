"""Flag-only signal handlers, the agreement rule, and how an attempt's end is recorded."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace

from lightning_ft.fault import CheckpointedStop
from lightning_ft.fault.agreement import StopAgreement, decide
from lightning_ft.fault.internal import attempt_end_fields
from lightning_ft.fault.signals import PreemptionSignals


class Connector:
    def __init__(self) -> None:
        self.registered = 0

    def register_signal_handlers(self) -> None:  # what Lightning would do: its own handler on SIGTERM
        self.registered += 1


def test_a_signal_only_sets_a_flag_a_second_one_changes_nothing_and_teardown_puts_the_old_handler_back():
    before = signal.getsignal(signal.SIGUSR1)
    times = iter([10.0, 11.0])
    signals = PreemptionSignals((signal.SIGUSR1,), clock=lambda: next(times))
    connector = Connector()
    trainer = SimpleNamespace(_signal_connector=connector)
    signals.install(trainer)
    try:
        connector.register_signal_handlers()  # Trainer._run calls this before the training stage
        assert connector.registered == 0  # Lightning's registration was replaced by ours
        assert signal.getsignal(signal.SIGUSR1) == signals.handle
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.received is not None and signals.received.name == "SIGUSR1"
        assert signals.received.time == 10.0 and signals.count == 2
    finally:
        signals.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before
    connector.register_signal_handlers()
    assert connector.registered == 1  # the patch is undone


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


def test_attempt_end_says_how_the_attempt_ended():
    assert attempt_end_fields(None) == {"reason": "finished", "exit_code": 0}
    stop = CheckpointedStop(75, reason="preempted", checkpoint_path=Path("/c/preempt-step=4"))
    assert attempt_end_fields(stop) == {
        "reason": "preempted",
        "exit_code": 75,
        "checkpoint_path": "/c/preempt-step=4",
    }
    crashed = attempt_end_fields(OSError(28, "No space left on device"))
    assert crashed["reason"] == "crashed" and "No space left" in crashed["error"] and crashed["exit_code"] is None
