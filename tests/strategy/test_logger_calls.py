"""Loggers' ``after_save_checkpoint`` waits for the commit of the save it announces (unit level, with a fake writer);
the end-to-end comparison with DDPStrategy is in test_checkpoint_names.py."""

from __future__ import annotations

from lightning.pytorch.loggers import CSVLogger

from lightning_ft.strategy.logger_calls import DeferredLoggerCalls


class Recording(CSVLogger):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.seen: list[str] = []

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        self.seen.append(checkpoint_callback)


def test_a_call_made_while_a_save_is_in_flight_is_made_in_order_once_nothing_is_in_flight(tmp_path):
    writing = {"busy": False}
    logger = Recording(tmp_path)
    calls = DeferredLoggerCalls(busy=lambda: writing["busy"])
    calls.install([logger])

    logger.after_save_checkpoint("saved at once")  # nothing in flight: straight through
    assert logger.seen == ["saved at once"]
    writing["busy"] = True
    logger.after_save_checkpoint("first")
    logger.after_save_checkpoint("second")
    calls.replay()  # still in flight: kept
    assert logger.seen == ["saved at once"] and calls.pending == 2
    writing["busy"] = False
    logger.after_save_checkpoint("third")  # behind the kept ones, never before them
    assert logger.seen == ["saved at once"]
    calls.replay()
    assert logger.seen == ["saved at once", "first", "second", "third"] and calls.pending == 0


def test_uninstall_puts_the_loggers_own_method_back(tmp_path):
    logger = Recording(tmp_path)
    calls = DeferredLoggerCalls(busy=lambda: True)
    calls.install([logger])
    assert "after_save_checkpoint" in vars(logger)
    calls.uninstall()
    assert "after_save_checkpoint" not in vars(logger)
    logger.after_save_checkpoint("direct")
    assert logger.seen == ["direct"]
