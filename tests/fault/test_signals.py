"""Flag-only signal handlers (fault/signals.py): a signal sets a flag, and teardown puts the old handler back."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

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
