"""Flag-only signal handlers, the agreement rule, and how an attempt's end is recorded."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace

from lightning_ft.fault import CheckpointedStop, attempt_end_fields
from lightning_ft.fault.agreement import StopAgreement, decide
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
