"""Pre-flight health checks, one at a time, with real folders and a scripted NVML."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_ft.fault import HealthCheckError
from lightning_ft.fault.health import (
    Failure,
    check_checkpoint_dirs,
    check_collective,
    check_gpu,
    estimate_checkpoint_bytes,
    nvml_index,
    raise_if_failed,
)
from lightning_ft.nvml import FakeNVML


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.BatchNorm1d(100))  # 10100 + 200 params, 201 bufs


def _writable(dirpath: Path) -> None:
    if str(dirpath).startswith("/sys"):
        raise ValueError(f"ModelCheckpoint(dirpath={str(dirpath)!r}): cannot write into '/sys' (Permission denied)")


def test_the_checkpoint_size_counts_parameters_buffers_and_the_optimizer_state_to_come():
    model = _model()
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert estimate_checkpoint_bytes(model, []) == params + buffers
    assert estimate_checkpoint_bytes(model, [torch.optim.Adam(model.parameters())]) == 3 * params + buffers
    assert estimate_checkpoint_bytes(model, [torch.optim.SGD(model.parameters(), lr=0.1)]) == params + buffers
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert estimate_checkpoint_bytes(model, [sgd]) == 2 * params + buffers
    # Once the state exists it is measured, not estimated.
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 100)).sum().backward()
    adam.step()
    assert estimate_checkpoint_bytes(model, [adam]) >= 3 * params + buffers


def test_a_folder_that_cannot_be_written_is_a_user_error_naming_the_folder(tmp_path):
    failures = check_checkpoint_dirs(
        1, [Path("/sys/ckpt"), tmp_path], checkpoint_bytes=10, keep=lambda d: 1, check_dir=_writable
    )
    assert [(f.rank, f.check, f.user_error) for f in failures] == [(1, "checkpoint_dir", True)]
    assert "/sys/ckpt" in failures[0].detail


def test_a_disk_without_room_for_the_retained_checkpoints_fails_disk_space(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    ok = check_checkpoint_dirs(0, [tmp_path], checkpoint_bytes=free // 4, keep=lambda d: 2, check_dir=_writable)
    assert ok == []
    failures = check_checkpoint_dirs(0, [tmp_path], checkpoint_bytes=free // 2, keep=lambda d: 2, check_dir=_writable)
    assert [(f.check, f.user_error) for f in failures] == [("disk_space", False)]
    assert "2 retained checkpoint(s) plus one in flight" in failures[0].detail


def test_one_process_has_no_collective_to_check():
    assert check_collective(0, 1, torch.device("cpu")) == ([], None)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"ecc_uncorrected": 3.0}, "3 uncorrected ECC errors"),
        ({"retired_pages_pending": 1.0}, "retired memory page is pending"),
        ({"remapped_rows_pending": 1.0}, "row remap is pending"),
        ({"remapped_rows_failure": 1.0}, "row remap failed"),
    ],
)
def test_gpu_memory_faults_fail_the_gpu_check(fields, problem):
    nvml = FakeNVML(device_count=2)
    nvml.set(1, **fields)
    assert check_gpu(0, torch.device("cpu"), nvml) == []  # device 0 is healthy
    failures = check_gpu(3, torch.device("cuda", 1), nvml)
    assert len(failures) == 1 and failures[0].rank == 3 and failures[0].check == "gpu"
    assert problem in failures[0].detail and "NVML device 1" in failures[0].detail


def test_a_gpu_held_down_by_hardware_at_rest_fails_but_corrected_ecc_and_software_caps_do_not():
    nvml = FakeNVML(device_count=1)
    nvml.throttle(0, "SwPowerCap")
    nvml.set(0, ecc_corrected=12.0)
    assert check_gpu(0, torch.device("cuda", 0), nvml) == []
    nvml.throttle(0, "HwThermalSlowdown", "HwPowerBrakeSlowdown")
    (failure,) = check_gpu(0, torch.device("cuda", 0), nvml)
    assert "HwThermalSlowdown, HwPowerBrakeSlowdown" in failure.detail


def test_without_nvml_the_gpu_check_is_skipped_and_a_cpu_never_asks():
    assert check_gpu(0, torch.device("cuda", 0), FakeNVML(available=False)) == []
    assert check_gpu(0, torch.device("cpu")) == []


def test_nvml_index_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert nvml_index(1) == 6
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")
    assert nvml_index(0) == 0


def test_one_report_names_every_failing_rank_and_check():
    failures = [
        Failure(1, "gpu", "NVML device 1: 3 uncorrected ECC errors"),
        Failure(0, "checkpoint_dir", "ModelCheckpoint(dirpath='/sys/x'): cannot write", user_error=True),
    ]
    with pytest.raises(HealthCheckError) as raised:
        raise_if_failed(failures, world_size=4)
    message = str(raised.value)
    assert "2 of 4 rank(s) [0, 1]" in message
    assert message.index("rank 0 checkpoint_dir") < message.index("rank 1 gpu: NVML device 1")
    with pytest.raises(ValueError, match=r"rank 0 checkpoint_dir: .*dirpath='/sys/x'"):
        raise_if_failed(failures[1:], world_size=4)  # only the user's to fix: a ValueError
    raise_if_failed([], world_size=4)
