"""The fault handler (fault/fault_handler.py) inside a real one-process ``fit``: a real SIGTERM, the handlers, the health checks, the events."""

from __future__ import annotations

import signal

import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_ft import ElasticFT3D, FaultPolicy
from lightning_ft.checkpoint.internal import is_committed
from lightning_ft.events import read_events
from lightning_ft.fault import CheckpointedStop, FaultInjector
from lightning_ft.nvml import FakeNVML
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer


class SeeHandlers(Callback):
    def __init__(self) -> None:
        self.during_fit = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.during_fit = signal.getsignal(signal.SIGTERM)


def _events(root, name):
    return [e for e in read_events(root) if e["event"] == name]


def test_a_sigterm_mid_fit_commits_a_preempt_checkpoint_exits_75_and_the_next_fit_resumes_from_it(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    seen = SeeHandlers()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    injector = FaultInjector().signal_at(rank=0, step=2, sig="SIGTERM")
    trainer = make_trainer(tmp_path, callbacks=[ckpt, injector, seen], max_steps=10)
    with pytest.raises(SystemExit) as raised:
        trainer.fit(TinyRegressor())
    assert isinstance(raised.value, CheckpointedStop) and raised.value.code == 75
    # The signal arrived while step 3 ran; on one process the flag is read at that step's end.
    assert trainer.global_step == 3 and is_committed(tmp_path / "ckpt" / "preempt-step=3")
    assert getattr(seen.during_fit, "__self__", None) is trainer.strategy._fault.signals  # ours, not Lightning's
    assert signal.getsignal(signal.SIGTERM) == before  # restored at teardown
    (preempted,) = _events(tmp_path, "preempted")
    assert preempted["signal"] == "SIGTERM" and preempted["own_signal"] == "SIGTERM" and preempted["exit_code"] == 75
    assert preempted["checkpoint_path"] == str(tmp_path / "ckpt" / "preempt-step=3")
    assert preempted["signal_time"] <= preempted["agreed_time"] <= preempted["time"]
    (end,) = _events(tmp_path, "attempt_end")
    assert end["reason"] == "preempted" and end["exit_code"] == 75

    as_a_new_process()  # the relaunch after the exit with 75
    again = make_trainer(
        tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)], max_steps=6
    )
    again.fit(TinyRegressor())
    (resumed,) = _events(tmp_path, "resumed")
    assert resumed["step"] == 3 and resumed["path"].endswith("preempt-step=3") and resumed["load_s"] > 0
    assert [e["reason"] for e in _events(tmp_path, "attempt_end")] == ["preempted", "finished"]


def test_without_a_fault_policy_lightning_keeps_its_own_handlers_and_nothing_of_ours_runs(tmp_path):
    seen = SeeHandlers()
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(fault=None), callbacks=[seen], max_steps=2)
    trainer.fit(TinyRegressor())
    assert type(seen.during_fit).__name__ == "_HandlersCompose"  # Lightning's
    assert _events(tmp_path, "health_check") == []
    assert not any(type(cb).__name__ == "FaultHandler" for cb in trainer.callbacks)


@pytest.mark.usefixtures("event_log_on_disk")  # a passed check is not an incident: on disk only when kept
def test_a_passed_health_check_is_recorded_before_the_first_step(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=1)
    make_trainer(tmp_path, callbacks=[ckpt], max_steps=2).fit(TinyRegressor())
    (check,) = _events(tmp_path, "health_check")
    (first,) = _events(tmp_path, "first_step")
    assert check["passed"] and check["time"] < first["time"] and check["step"] is None and check["periodic"] is False
    model_bytes = sum(p.numel() * 4 for p in TinyRegressor().parameters())
    assert check["checkpoint_bytes_estimate"] == 3 * model_bytes  # Adam: parameters plus two moments


class EccFrom(Callback):
    """The fake NVML device reports an uncorrected ECC error from the start of step ``step``."""

    def __init__(self, nvml: FakeNVML, step: int) -> None:
        self.nvml, self.step = nvml, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.nvml.set(0, ecc_uncorrected=1.0)


def test_a_periodic_check_that_finds_an_ecc_error_commits_a_preempt_checkpoint_and_exits_75(tmp_path):
    fault = FaultPolicy(health_check_every_n_steps=2, health_check_action="checkpoint_and_stop")
    strategy = ElasticFT3D(fault=fault)
    nvml = FakeNVML(device_count=1)
    strategy._fault.nvml = nvml  # the NVML seam of the health checks (a CPU has no NVML)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=100)
    trainer = make_trainer(tmp_path, strategy=strategy, callbacks=[ckpt, EccFrom(nvml, 3)], max_steps=10)
    with pytest.raises(SystemExit) as raised:
        trainer.fit(TinyRegressor())
    assert isinstance(raised.value, CheckpointedStop) and raised.value.code == 75
    assert trainer.global_step == 4 and is_committed(tmp_path / "ckpt" / "preempt-step=4")
    checks = _events(tmp_path, "health_check")
    assert [(c["periodic"], c["step"]) for c in checks] == [(False, None), (True, 2)]
    (failed,) = _events(tmp_path, "health_check_failed")
    assert failed["periodic"] and failed["step"] == 4 and failed["ranks"] == [0]
    assert [(c["rank"], c["check"]) for c in failed["checks"]] == [(0, "gpu")]
    (end,) = _events(tmp_path, "attempt_end")
    assert end["reason"] == "stopped" and end["exit_code"] == 75


def test_a_failed_health_check_stops_before_any_step_with_the_report(tmp_path):
    ckpt = ModelCheckpoint(dirpath="/sys/lightning_ft_ckpt", every_n_train_steps=2)
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(fault=FaultPolicy()), callbacks=[ckpt], max_steps=2)
    with pytest.raises(ValueError, match=r"1 of 1 rank\(s\) \[0\].*\n  rank 0 checkpoint_dir: .*cannot write into"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0 and _events(tmp_path, "first_step") == []
    (failed,) = _events(tmp_path, "health_check_failed")
    assert failed["checks"][0]["rank"] == 0 and failed["checks"][0]["check"] == "checkpoint_dir"
    (end,) = _events(tmp_path, "attempt_end")
    assert end["reason"] == "crashed" and "checkpoint_dir" in end["error"]


def test_health_check_action_evict_is_refused_before_any_step_where_no_torchrun_agent_could_leave(tmp_path):
    strategy = ElasticFT3D(fault=FaultPolicy(health_check_every_n_steps=2, health_check_action="evict"))
    trainer = make_trainer(tmp_path, strategy=strategy, max_steps=4)
    with pytest.raises(ValueError, match=r"FaultPolicy\(health_check_action='evict'\): .*torchrun"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0
