"""ThermalMonitor and the pre-flight ``gpu`` check on a real device, through the real NVML seam (no fake)."""

from __future__ import annotations

import pytest
import torch

from lightning_ft.fault.health import check_gpu
from lightning_ft.monitors import ThermalMonitor
from tests.monitors.test_thermal_monitor import fake_trainer, run_windows

pytestmark = pytest.mark.gpu


def test_thermal_monitor_reads_the_real_device_and_logs_its_temperature_and_clocks(tmp_path):
    monitor = ThermalMonitor(interval=2)
    trainer = fake_trainer(tmp_path)
    trainer.strategy.root_device = torch.device("cuda", 0)
    monitor.setup(trainer, None, "fit")
    try:
        assert monitor.enabled, "NVML could not read the device"
        run_windows(monitor, trainer, 2)
    finally:
        monitor.teardown(trainer, None, "fit")
    logged = trainer.loggers[0].metrics[-1]
    assert logged["thermal/temperature_c/rank_0"] > 0
    assert logged["thermal/max_sm_clock_mhz/rank_0"] >= logged["thermal/sm_clock_mhz/rank_0"] > 0
    assert logged["thermal/throttled/rank_0"] in (0.0, 1.0)


def test_the_gpu_health_check_reads_the_real_device_and_passes_on_a_healthy_one():
    failures = check_gpu(0, torch.device("cuda", 0))
    assert failures == [], "; ".join(f.detail for f in failures)
