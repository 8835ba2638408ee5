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


class ScanView(CSVLogger):
    """Records what Lightning's scan reads from the callback at each call, as an uploading logger does."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.seen: list[tuple] = []

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        self.seen.append(
            (
                checkpoint_callback.best_model_path,
                checkpoint_callback.last_model_path,
                sorted(checkpoint_callback.best_k_models),
            )
        )


def test_a_kept_call_sees_the_callback_as_it_was_at_the_call_and_leaves_it_as_it_is(tmp_path):
    from weakref import proxy

    from lightning.pytorch.callbacks import ModelCheckpoint

    writing = {"busy": True}
    logger = ScanView(tmp_path)
    calls = DeferredLoggerCalls(busy=lambda: writing["busy"])
    calls.install([logger])
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    mc.best_model_path, mc.last_model_path, mc.best_k_models = "step=2.ckpt", "last.ckpt", {"step=2.ckpt": 1.0}
    logger.after_save_checkpoint(proxy(mc))  # as ModelCheckpoint calls it
    # The next save changes the callback (a dict in place, the rest replaced) before the first save commits.
    mc.best_model_path = "step=4.ckpt"
    mc.best_k_models["step=4.ckpt"] = 0.5
    logger.after_save_checkpoint(proxy(mc))
    writing["busy"] = False
    calls.replay()
    assert logger.seen == [
        ("step=2.ckpt", "last.ckpt", ["step=2.ckpt"]),
        ("step=4.ckpt", "last.ckpt", ["step=2.ckpt", "step=4.ckpt"]),
    ]
    assert mc.best_model_path == "step=4.ckpt" and sorted(mc.best_k_models) == ["step=2.ckpt", "step=4.ckpt"]


def test_a_path_a_kept_call_names_is_changed_only_after_the_call_is_made(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    writing = {"busy": True, "waits": 0}

    def wait() -> None:
        writing["waits"] += 1
        writing["busy"] = False

    logger = ScanView(tmp_path)
    calls = DeferredLoggerCalls(busy=lambda: writing["busy"], wait=wait)
    calls.install([logger])
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    mc.best_model_path, mc.last_model_path = str(tmp_path / "step=2.ckpt"), str(tmp_path / "last.ckpt")
    logger.after_save_checkpoint(mc)
    calls.settle(tmp_path / "step=0.ckpt")  # named by no kept call: no wait
    assert writing["waits"] == 0 and calls.pending == 1
    calls.settle(tmp_path / "last.ckpt")  # the next save would replace it: the call is made first
    assert writing["waits"] == 1 and calls.pending == 0 and len(logger.seen) == 1


def test_a_call_of_a_callback_that_links_last_waits_for_the_save_in_flight(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    writing = {"busy": True}
    logger = ScanView(tmp_path)
    calls = DeferredLoggerCalls(busy=lambda: writing["busy"], wait=lambda: writing.update(busy=False))
    calls.install([logger])
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_last="link")
    logger.after_save_checkpoint(mc)  # Lightning moves the link right after this call
    assert len(logger.seen) == 1 and calls.pending == 0


def test_loggers_whose_call_does_nothing_are_left_alone(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    plain, board = CSVLogger(tmp_path), TensorBoardLogger(tmp_path)
    calls = DeferredLoggerCalls(busy=lambda: True)
    calls.install([plain, board])
    assert "after_save_checkpoint" not in vars(plain) and "after_save_checkpoint" not in vars(board)
    plain.after_save_checkpoint(None)
    assert calls.pending == 0
