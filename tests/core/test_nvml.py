from __future__ import annotations

import pytest
import torch

from lightning_ft.monitors import FakeNVML
from lightning_ft.monitors._timing import StepClock
from lightning_ft.monitors.internal import NVML
from lightning_ft.nvml import READING_FIELDS, REASONS, NVMLUnavailable, decode_reasons


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_real_nvml_on_a_machine_without_a_gpu_says_it_is_unavailable():
    with pytest.raises(NVMLUnavailable):
        NVML().init()


@pytest.mark.gpu
def test_real_nvml_reads_every_field_or_marks_it_unsupported():
    nvml = NVML()
    nvml.init()
    try:
        reading = nvml.read(0)
    finally:
        nvml.shutdown()
    assert set(reading) == set(READING_FIELDS)
    assert reading["temperature_c"] is not None and reading["temperature_c"] > 0


@pytest.mark.gpu
def test_cuda_events_time_the_device_part_of_a_step():
    clock = StepClock(torch.device("cuda", 0))
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        clock.step_start()
        y = x @ x
        clock.backward_start()
        (y @ x).sum()
        clock.backward_end()
        clock.step_end()
    samples = clock.drain()
    assert len(samples) == 3
    assert all(s["compute"] > 0 and s["backward"] > 0 for s in samples)


def test_every_reason_bit_of_the_installed_bindings_is_decoded_by_its_name():
    pynvml = pytest.importorskip("pynvml")
    checked = set()
    for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
        for attr in dir(pynvml):
            name = attr.removeprefix(prefix)
            if not attr.startswith(prefix) or name in ("All", "None", "GpuIdle", "UserDefinedClocks"):
                continue
            assert decode_reasons(getattr(pynvml, attr)) == [name]
            checked.add(name)
    # The loop must have met every reason we decode, or it checked less than it claims.
    assert checked == set(REASONS) - {"GpuIdle"}


def test_fake_nvml_rejects_unknown_reasons_and_fields():
    nvml = FakeNVML(device_count=1)
    with pytest.raises(ValueError, match="HotGpu"):
        nvml.throttle(0, "HotGpu")
    with pytest.raises(ValueError, match="fan_rpm"):
        nvml.set(0, fan_rpm=1.0)
    assert set(REASONS) >= {"HwThermalSlowdown", "SwPowerCap"}


def test_fake_nvml_answers_a_missing_device_like_nvml():
    with pytest.raises(NVMLUnavailable, match="device 3"):
        FakeNVML(device_count=2).read(3)
