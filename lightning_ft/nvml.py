"""The one place that talks to NVML (``pynvml`` from nvidia-ml-py), and a fake of it for tests and CPU demos.

:class:`NVML` reads one device in one call (:meth:`NVML.read`), mapping NVML's "not supported" answers to ``None``
per field, so a query a GPU cannot answer is skipped instead of failing. :class:`FakeNVML` has the same interface
and holds scripted readings: tests throttle a device with it, and the CPU demo stages a thermal incident with it.
The rest of lightning-ft never imports ``pynvml``. A shared leaf (like :mod:`lightning_ft.events`): the thermal monitor
and the pre-flight health checks of ``fault/`` both read it, and it imports nothing of lightning-ft.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol

READING_FIELDS = (
    "temperature_c",
    "slowdown_temperature_c",
    "sm_clock_mhz",
    "max_sm_clock_mhz",
    "power_w",
    "power_limit_w",
    "reasons_bits",
    "thermal_violation_ns",
    "power_violation_ns",
    "ecc_corrected",
    "ecc_uncorrected",
    "retired_pages_pending",
    "remapped_rows_pending",
    "remapped_rows_failure",
)
"""Keys of a reading. Violation times are NVML's cumulative counters (nanoseconds); ECC counts are volatile totals;
the last three are 1.0 when a retired page or a row remap awaits a reset, or a remap failed (else 0.0)."""

# Bit values of NVML's clock-event reasons (``nvmlClocksEventReason*``, formerly ``nvmlClocksThrottleReason*``).
# Spelled out so that decoding does not depend on the installed bindings' names.
REASONS: dict[str, int] = {
    "GpuIdle": 0x1,
    "ApplicationsClocksSetting": 0x2,
    "SwPowerCap": 0x4,
    "HwSlowdown": 0x8,
    "SyncBoost": 0x10,
    "SwThermalSlowdown": 0x20,
    "HwThermalSlowdown": 0x40,
    "HwPowerBrakeSlowdown": 0x80,
    "DisplayClockSetting": 0x100,
    "BoardLimit": 0x200,
    "Reliability": 0x400,
}
"""Clock-event reason name -> bit."""


class NVMLUnavailable(RuntimeError):
    """NVML cannot be used here: the library is missing, there is no driver, or the device index does not exist."""


def decode_reasons(bits: int) -> list[str]:
    """Names of the clock-event reasons set in ``bits``, without ``GpuIdle`` (an idle GPU is not throttled).

    Unknown bits are reported as ``"Unknown0x..."`` so a newer driver's reason is not silently lost.
    """
    names = [name for name, bit in REASONS.items() if bits & bit and name != "GpuIdle"]
    known = 0
    for bit in REASONS.values():
        known |= bit
    if bits & ~known:
        names.append(f"Unknown{bits & ~known:#x}")
    return names


class NVMLLike(Protocol):
    """What :class:`~lightning_ft.monitors.thermal_monitor.ThermalMonitor` needs from NVML."""

    def init(self) -> None: ...

    def device_count(self) -> int: ...

    def read(self, index: int) -> dict[str, float | None]: ...

    def shutdown(self) -> None: ...


class NVML:
    """Real NVML through ``pynvml``. :meth:`init` raises :class:`NVMLUnavailable` when NVML cannot be used.

    Example::

        nvml = NVML()
        nvml.init()
        print(nvml.read(0)["temperature_c"])
        nvml.shutdown()
    """

    def __init__(self) -> None:
        self._pynvml: Any = None
        self._handles: dict[int, Any] = {}

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as err:
            raise NVMLUnavailable("the nvidia-ml-py package (pynvml) is not installed") from err
        try:
            pynvml.nvmlInit()
        except Exception as err:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            raise NVMLUnavailable(f"NVML did not initialise: {err}") from err
        self._pynvml = pynvml

    def device_count(self) -> int:
        return int(self._pynvml.nvmlDeviceGetCount())

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            try:
                self._handles[index] = self._pynvml.nvmlDeviceGetHandleByIndex(index)
            except self._pynvml.NVMLError as err:
                raise NVMLUnavailable(f"NVML device {index}: {err}") from err
        return self._handles[index]

    def read(self, index: int) -> dict[str, float | None]:
        nv = self._pynvml
        h = self._handle(index)
        reasons_fn = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        queries = {
            "temperature_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "slowdown_temperature_c": lambda: nv.nvmlDeviceGetTemperatureThreshold(
                h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            ),
            "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "max_sm_clock_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
            "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "power_limit_w": lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            "reasons_bits": lambda: reasons_fn(h),
            "thermal_violation_ns": lambda: (
                nv.nvmlDeviceGetViolationStatus(h, nv.NVML_PERF_POLICY_THERMAL).violationTime
            ),
            "power_violation_ns": lambda: nv.nvmlDeviceGetViolationStatus(h, nv.NVML_PERF_POLICY_POWER).violationTime,
            "ecc_corrected": lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC
            ),
            "ecc_uncorrected": lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
            # Pre-Ampere boards retire pages, Ampere and later remap rows; each answers NotSupported for the other.
            "retired_pages_pending": lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h),
            "remapped_rows_pending": lambda: nv.nvmlDeviceGetRemappedRows(h)[2],
            "remapped_rows_failure": lambda: nv.nvmlDeviceGetRemappedRows(h)[3],
        }
        reading: dict[str, float | None] = {}
        for name, query in queries.items():
            try:
                reading[name] = float(query())
            except nv.NVMLError:
                # NotSupported (no ECC on consumer boards, no violation counters on some SKUs), NoPermission, ...:
                # that one field is unknown, the rest of the reading stands.
                reading[name] = None
        return reading

    def shutdown(self) -> None:
        if self._pynvml is not None:
            try:
                self._pynvml.nvmlShutdown()
            except Exception:
                pass
            self._pynvml = None
            self._handles = {}


class FakeNVML:
    """Scripted NVML for tests and CPU demos: every device reads as a healthy, cool GPU until told otherwise.

    Args:
        device_count: devices it pretends to have.
        available: ``False`` makes :meth:`init` fail like a machine without a driver.
        unsupported: reading fields that answer "not supported" (read as ``None``).

    Example::

        nvml = FakeNVML(device_count=4)
        nvml.throttle(2, "HwThermalSlowdown", temperature_c=94.0, sm_clock_mhz=900.0)
        trainer = L.Trainer(callbacks=[ThermalMonitor(nvml=nvml)])
    """

    HEALTHY: dict[str, float] = {
        "temperature_c": 60.0,
        "slowdown_temperature_c": 90.0,
        "sm_clock_mhz": 1980.0,
        "max_sm_clock_mhz": 1980.0,
        "power_w": 400.0,
        "power_limit_w": 700.0,
        "reasons_bits": 0.0,
        "thermal_violation_ns": 0.0,
        "power_violation_ns": 0.0,
        "ecc_corrected": 0.0,
        "ecc_uncorrected": 0.0,
        "retired_pages_pending": 0.0,
        "remapped_rows_pending": 0.0,
        "remapped_rows_failure": 0.0,
    }

    def __init__(self, *, device_count: int = 8, available: bool = True, unsupported: Iterable[str] = ()) -> None:
        unknown = set(unsupported) - set(READING_FIELDS)
        if unknown:
            raise ValueError(f"FakeNVML(unsupported={sorted(unknown)}): not reading fields {READING_FIELDS}")
        self._count = device_count
        self._available = available
        self._unsupported = set(unsupported)
        self._lock = threading.Lock()
        self._state = {i: dict(self.HEALTHY) for i in range(device_count)}
        self.initialised = False

    def init(self) -> None:
        if not self._available:
            raise NVMLUnavailable("NVML did not initialise: fake NVML set to unavailable")
        self.initialised = True

    def device_count(self) -> int:
        return self._count

    def set(self, index: int, **fields: float) -> None:
        """Overwrite reading fields of device ``index``."""
        bad = set(fields) - set(READING_FIELDS)
        if bad:
            raise ValueError(f"FakeNVML.set({sorted(bad)}): not reading fields {READING_FIELDS}")
        with self._lock:
            self._state[index].update({k: float(v) for k, v in fields.items()})

    def throttle(self, index: int, *reasons: str, **fields: float) -> None:
        """Make device ``index`` report ``reasons`` (names from :data:`REASONS`) and optionally other fields."""
        bad = [r for r in reasons if r not in REASONS]
        if bad:
            raise ValueError(f"FakeNVML.throttle({bad}): unknown reasons; known: {sorted(REASONS)}")
        bits = 0
        for r in reasons:
            bits |= REASONS[r]
        self.set(index, reasons_bits=float(bits), **fields)

    def clear(self, index: int) -> None:
        """Back to a healthy, unthrottled reading (cumulative counters keep their values)."""
        with self._lock:
            state = self._state[index]
            memory = ("ecc_corrected", "ecc_uncorrected", "retired_pages_pending", "remapped_rows_pending")
            keep = {
                k: state[k] for k in ("thermal_violation_ns", "power_violation_ns", *memory, "remapped_rows_failure")
            }
            self._state[index] = {**self.HEALTHY, **keep}

    def is_throttled(self, index: int) -> bool:
        """Whether device ``index`` currently reports any reason other than ``GpuIdle``."""
        return bool(decode_reasons(int(self._state[index]["reasons_bits"])))

    def read(self, index: int) -> dict[str, float | None]:
        if not 0 <= index < self._count:
            raise NVMLUnavailable(f"NVML device {index}: no such device (fake has {self._count})")
        with self._lock:
            state = dict(self._state[index])
        return {k: (None if k in self._unsupported else state[k]) for k in READING_FIELDS}

    def shutdown(self) -> None:
        self.initialised = False
