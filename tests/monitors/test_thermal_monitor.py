from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.events import EventLog, read_events
from lightning_ft.monitors import FakeNVML, ThermalMonitor
from lightning_ft.nvml import REASONS, decode_reasons
from tests.monitors.tiny_module import TinyModule


class RecordingLogger:
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))
        self.logged.append((step, dict(metrics)))


def fake_trainer(tmp_path, local_rank: int = 0, attempt: int = 0):
    """Just what ThermalMonitor touches on a one-process trainer."""
    log = EventLog(tmp_path, rank=local_rank, run_id="t", attempt=attempt)
    return SimpleNamespace(
        local_rank=local_rank,
        global_rank=local_rank,
        global_step=0,
        is_global_zero=True,
        loggers=[RecordingLogger()],
        strategy=SimpleNamespace(root_device=torch.device("cpu"), event_log=log),
        default_root_dir=str(tmp_path),
    )


def run_windows(monitor: ThermalMonitor, trainer, windows: int) -> None:
    """Train ``windows`` intervals and end training, which logs the readings still being gathered."""
    for _ in range(windows * monitor.interval):
        trainer.global_step += 1
        monitor.on_train_batch_end(trainer, None, None, None, 0)
    monitor.on_train_end(trainer, None)


def thermal_events(tmp_path) -> list[dict]:
    return [e for e in read_events(tmp_path) if e["event"] == "thermal"]


@pytest.mark.parametrize("reason", sorted(set(REASONS) - {"GpuIdle"}))
def test_each_throttle_reason_is_decoded_by_name_in_a_thermal_event(tmp_path, reason):
    nvml = FakeNVML(device_count=2)
    monitor = ThermalMonitor(interval=2, nvml=nvml)
    trainer = fake_trainer(tmp_path, local_rank=1)
    monitor.setup(trainer, None, "fit")
    run_windows(monitor, trainer, 1)
    nvml.throttle(1, reason)
    run_windows(monitor, trainer, 1)
    (event,) = thermal_events(tmp_path)
    assert event["reasons"] == [reason]
    assert event["device"] == 1
    assert event["throttled"] is True
    assert trainer.loggers[0].metrics[-1]["thermal/throttled/rank_0"] == 1.0


def test_an_idle_gpu_is_not_reported_as_throttled(tmp_path):
    nvml = FakeNVML(device_count=1)
    nvml.throttle(0, "GpuIdle")
    monitor = ThermalMonitor(interval=1, nvml=nvml)
    trainer = fake_trainer(tmp_path)
    monitor.setup(trainer, None, "fit")
    run_windows(monitor, trainer, 3)
    assert thermal_events(tmp_path) == []
    assert trainer.loggers[0].metrics[-1]["thermal/throttled/rank_0"] == 0.0


def test_entering_and_leaving_throttling_each_write_one_event(tmp_path):
    nvml = FakeNVML(device_count=1)
    monitor = ThermalMonitor(interval=1, nvml=nvml)
    trainer = fake_trainer(tmp_path)
    monitor.setup(trainer, None, "fit")
    nvml.throttle(0, "HwThermalSlowdown", "SwPowerCap", temperature_c=95.0, sm_clock_mhz=1000.0)
    run_windows(monitor, trainer, 3)
    nvml.clear(0)
    run_windows(monitor, trainer, 3)
    entered, left = thermal_events(tmp_path)
    assert entered["reasons"] == ["SwPowerCap", "HwThermalSlowdown"]
    assert (entered["temperature_c"], entered["sm_clock_mhz"]) == (95.0, 1000.0)
    assert left["reasons"] == [] and left["throttled"] is False


def test_violation_time_is_reported_per_interval_in_seconds(tmp_path):
    nvml = FakeNVML(device_count=1)
    monitor = ThermalMonitor(interval=1, nvml=nvml)
    trainer = fake_trainer(tmp_path)
    monitor.setup(trainer, None, "fit")
    # NVML's counters are cumulative since the driver loaded: what was there before training is not this interval's.
    nvml.set(0, thermal_violation_ns=4e9, power_violation_ns=2e9)
    run_windows(monitor, trainer, 1)
    nvml.set(0, thermal_violation_ns=6.5e9, power_violation_ns=3e9)
    run_windows(monitor, trainer, 1)
    last = trainer.loggers[0].metrics[-1]
    assert last["thermal/thermal_violation_s/rank_0"] == 2.5
    assert last["thermal/power_violation_s/rank_0"] == 1.0


def test_a_query_the_gpu_does_not_support_is_skipped_and_the_rest_is_logged(tmp_path):
    nvml = FakeNVML(device_count=1, unsupported=["ecc_corrected", "ecc_uncorrected", "power_limit_w"])
    monitor = ThermalMonitor(interval=1, nvml=nvml)
    trainer = fake_trainer(tmp_path)
    monitor.setup(trainer, None, "fit")
    run_windows(monitor, trainer, 1)
    last = trainer.loggers[0].metrics[-1]
    assert "thermal/ecc_corrected/rank_0" not in last
    assert "thermal/power_limit_w/rank_0" not in last
    assert last["thermal/temperature_c/rank_0"] == FakeNVML.HEALTHY["temperature_c"]


def test_after_a_restart_readings_of_steps_an_earlier_attempt_reached_are_not_logged_again(tmp_path):
    EventLog(tmp_path, rank=0, run_id="t", attempt=0).write("progress", step=6, productive_s=1.0, data_wait_s=0.0)
    nvml = FakeNVML(device_count=1)
    monitor = ThermalMonitor(interval=2, nvml=nvml)
    trainer = fake_trainer(tmp_path, attempt=1)
    monitor.setup(trainer, None, "fit")
    trainer.global_step = 2  # resumed from a checkpoint at step 2
    monitor.on_train_start(trainer, None)
    run_windows(monitor, trainer, 4)
    assert [step for step, _ in trainer.loggers[0].logged] == [8, 10]


def test_devices_option_picks_the_nvml_index_of_each_local_rank(tmp_path):
    nvml = FakeNVML(device_count=8)
    nvml.throttle(6, "HwSlowdown")
    monitor = ThermalMonitor(interval=1, nvml=nvml, devices=[7, 6])
    trainer = fake_trainer(tmp_path, local_rank=1)
    monitor.setup(trainer, None, "fit")
    run_windows(monitor, trainer, 1)
    assert monitor.device_index == 6
    assert thermal_events(tmp_path)[0]["reasons"] == ["HwSlowdown"]


def test_devices_without_an_entry_for_the_local_rank_is_a_value_error(tmp_path):
    monitor = ThermalMonitor(nvml=FakeNVML(), devices=[0])
    with pytest.raises(ValueError, match=r"devices=\[0\].*local rank 1"):
        monitor.setup(fake_trainer(tmp_path, local_rank=1), None, "fit")


def test_unknown_reason_bits_are_kept_not_dropped():
    assert decode_reasons(0x40 | 0x8000) == ["HwThermalSlowdown", "Unknown0x8000"]


def test_without_nvml_the_monitor_warns_once_turns_off_and_training_completes(tmp_path):
    monitor = ThermalMonitor(interval=1, nvml=FakeNVML(available=False))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    data = DataLoader(TensorDataset(torch.randn(20, 4)), batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModule(), data)
    messages = [str(w.message) for w in caught if "ThermalMonitor" in str(w.message)]
    assert len(messages) == 1 and "no rank can read NVML" in messages[0]
    assert monitor.enabled is False
    assert trainer.global_step == 5
