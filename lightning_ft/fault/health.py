"""Pre-flight health checks: what would fail later, checked on every rank before the first step.

Each rank checks:

- ``checkpoint_dir``: every ``ModelCheckpoint`` ``dirpath`` can be written (a real file, not just permissions);
- ``disk_space``: its filesystem has room for the retained checkpoints plus the one in flight, estimated from the
  model and optimizer state size (:func:`estimate_checkpoint_bytes`);
- ``collective``: an all-reduce on the training process group returns the right values; its bus bandwidth and the
  round trip of a one-element all-reduce are measured and reported (the baseline of the periodic checks,
  :mod:`~lightning_ft.fault.periodic_health`);
- ``gpu`` (CUDA devices only, through NVML): no uncorrected ECC errors, no retired page or row remap pending a reset,
  no failed remap, no hardware slowdown (thermal, power brake) at rest.

Then all ranks exchange their results and every rank raises the same error, naming each failing rank and check, so
either all ranks start or none does. A failure that is the user's to fix (an unwritable or missing folder) raises
``ValueError``; any other raises :class:`HealthCheckError`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.internal import existing_ancestor, is_remote
from lightning_ft.nvml import NVML, NVMLUnavailable, decode_reasons

# Optimizer state per parameter, in parameter-sized tensors, for optimizers whose state does not exist yet (it is
# created at the first step). Unknown optimizers count as Adam, the common worst case.
_STATE_PER_PARAM = {"SGD": 1, "Adagrad": 1, "RMSprop": 2, "Adadelta": 2}
_ADAM_LIKE = 2
_HW_SLOWDOWNS = ("HwSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown")
CHECKS = ("checkpoint_dir", "disk_space", "collective", "gpu")
PERIODIC_CHECKS = ("collective", "gpu")
"""The checks repeated during training (:mod:`~lightning_ft.fault.periodic_health`)."""


class HealthCheckError(RuntimeError):
    """A pre-flight health check failed on at least one rank; the message names each failing rank and check."""


@dataclass(frozen=True)
class Failure:
    """One failed check on one rank."""

    rank: int
    check: str
    detail: str
    user_error: bool = False
    """The user can fix it in the configuration (a missing or unwritable folder)."""


def estimate_checkpoint_bytes(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes one checkpoint of ``module`` and ``optimizers`` takes, all ranks together.

    Parameters and buffers count at their global size (a DTensor's ``numel()`` is global; data-parallel replicas are
    written once). Optimizer state is measured where it exists and estimated per optimizer type where it does not
    yet (``SGD`` one tensor per parameter, Adam-like two).
    """
    total = sum(t.numel() * t.element_size() for t in module.parameters())
    total += sum(t.numel() * t.element_size() for t in module.buffers())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param)
                if state:
                    total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
                else:
                    factor = _STATE_PER_PARAM.get(type(optimizer).__name__, _ADAM_LIKE)
                    if type(optimizer).__name__ == "SGD" and not group.get("momentum"):
                        factor = 0
                    total += factor * param.numel() * param.element_size()
    return int(total)


def check_checkpoint_dirs(
    rank: int,
    dirpaths: Iterable[str | Path],
    *,
    checkpoint_bytes: int,
    keep: Callable[[Path], int],
    check_dir: Callable[[str], None],
) -> list[Failure]:
    """``checkpoint_dir`` and ``disk_space`` on this rank.

    ``dirpaths`` as the user gave them; ``keep(dirpath)`` is how many more checkpoints will be retained in it;
    ``check_dir`` raises ``ValueError`` for a folder that cannot be used (not writable, not a local path).
    """
    failures = []
    for raw in dirpaths:
        try:
            check_dir(str(raw))
        except ValueError as err:
            failures.append(Failure(rank, "checkpoint_dir", str(err), user_error=True))
            continue
        if is_remote(raw):
            continue  # an object store has no local disk whose free space means anything
        dirpath = Path(raw)
        free = shutil.disk_usage(existing_ancestor(dirpath)).free
        # The retained checkpoints, plus the one being written before retention removes the oldest.
        needed = checkpoint_bytes * (keep(dirpath) + 1)
        if free < needed:
            failures.append(
                Failure(
                    rank,
                    "disk_space",
                    f"{dirpath}: {free / 1e9:.2f} GB free, {needed / 1e9:.2f} GB needed for {keep(dirpath)} retained"
                    f" checkpoint(s) plus one in flight of about {checkpoint_bytes / 1e9:.2f} GB each",
                )
            )
    return failures


def collective_numel(device: torch.device) -> int:
    """float32 elements of the sized all-reduce: 64 MiB on GPUs, 4 MiB on CPUs."""
    return (16 << 20) if device.type == "cuda" else (1 << 20)


def check_collective(rank: int, world_size: int, device: torch.device) -> tuple[list[Failure], float | None]:
    """``collective``: an all-reduce on the default group returns ``1 + 2 + ... + world_size`` everywhere.

    Collective. Returns the failures and the measured bus bandwidth in GB/s (``None`` on one rank).
    """
    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return [], None
    numel = collective_numel(device)
    buffer = torch.empty(numel, dtype=torch.float32, device=device)
    expected = world_size * (world_size + 1) / 2
    best = float("inf")
    wrong = None
    for i in range(4):  # one warm-up, three timed
        buffer.fill_(float(rank + 1))
        sync(device)
        start = time.perf_counter()
        dist.all_reduce(buffer)
        sync(device)
        if i:
            best = min(best, time.perf_counter() - start)
        if wrong is None and not bool(torch.all(buffer == expected)):
            bad = buffer[buffer != expected]
            wrong = f"all-reduce returned {float(bad[0])} (expected {expected:g}) in {bad.numel()} of {numel} elements"
    busbw = numel * 4 * 2 * (world_size - 1) / world_size / best / 1e9
    return ([Failure(rank, "collective", wrong)] if wrong else []), busbw


def measure_latency(world_size: int, device: torch.device, *, repeats: int = 10) -> float | None:
    """The collective round trip: seconds of the fastest of ``repeats`` one-element all-reduces (after one warm-up).

    The fastest of many, so that a rank descheduled for a moment on a busy host does not read as a slow link.
    Collective on the default group. ``None`` on one rank or without torch.distributed.
    """
    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return None
    buffer = torch.zeros(1, dtype=torch.float32, device=device)
    best = float("inf")
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        dist.all_reduce(buffer)
        sync(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA device); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nvml_index(cuda_index: int) -> int:
    """NVML's index of CUDA device ``cuda_index`` (NVML ignores ``CUDA_VISIBLE_DEVICES``, CUDA renumbers)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if cuda_index < len(visible) and visible[cuda_index].isdigit():
        return int(visible[cuda_index])
    return cuda_index


def check_gpu(rank: int, device: torch.device, nvml: Any = None, *, at_rest: bool = True) -> list[Failure]:
    """``gpu``: ECC, retired pages and row remaps, hardware slowdown, from NVML. Nothing on a CPU.

    ``nvml``: an object like :class:`~lightning_ft.nvml.NVML` (tests pass a ``FakeNVML``); ``None`` opens the
    real one. A machine where NVML cannot be used skips the check (the training would not use NVML either).
    ``at_rest``: the wording of a slowdown (before training the GPU is at rest; the periodic checks run under load,
    where software power and thermal caps are normal and only the hardware slowdowns fail).
    """
    if device.type != "cuda" and nvml is None:
        return []
    nvml = nvml if nvml is not None else NVML()
    index = nvml_index(device.index or 0) if device.type == "cuda" else 0
    try:
        nvml.init()
        reading = nvml.read(index)
    except NVMLUnavailable:
        return []
    finally:
        nvml.shutdown()
    problems = []
    if (reading.get("ecc_uncorrected") or 0) > 0:
        problems.append(f"{reading['ecc_uncorrected']:.0f} uncorrected ECC errors since the last driver reload")
    if reading.get("retired_pages_pending"):
        problems.append("a retired memory page is pending (reset the GPU)")
    if reading.get("remapped_rows_pending"):
        problems.append("a memory row remap is pending (reset the GPU)")
    if reading.get("remapped_rows_failure"):
        problems.append("a memory row remap failed (the GPU needs service)")
    slowdown = [r for r in decode_reasons(int(reading.get("reasons_bits") or 0)) if r in _HW_SLOWDOWNS]
    if slowdown:
        problems.append(f"clocks held down{' at rest' if at_rest else ''} by {', '.join(slowdown)}")
    return [Failure(rank, "gpu", f"NVML device {index}: {p}") for p in problems]


def exchange(failures: list[Failure], info: dict[str, Any]) -> tuple[list[Failure], list[dict[str, Any]]]:
    """Every rank's failures and info, the same on every rank. Collective on the default group (if any)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failures, [info]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ([asdict(f) for f in failures], info))
    return [Failure(**f) for fs, _ in gathered for f in fs], [i for _, i in gathered]


def describe(failures: list[Failure], world_size: int, *, when: str, outcome: str) -> str:
    """The one report of ``failures``: ``lightning-ft <when> health check failed on ... rank(s) [...]; <outcome>:``
    and a line per failing rank and check."""
    ranks = sorted({f.rank for f in failures})
    lines = [f"  rank {f.rank} {f.check}: {f.detail}" for f in sorted(failures, key=lambda f: (f.rank, f.check))]
    head = f"lightning-ft {when} health check failed on {len(ranks)} of {world_size} rank(s) {ranks}; {outcome}:"
    return "\n".join([head, *lines])


def raise_if_failed(failures: list[Failure], world_size: int) -> None:
    """Raise the one report on every rank: ``ValueError`` when every failure is the user's to fix, else
    :class:`HealthCheckError`."""
    if not failures:
        return
    message = describe(failures, world_size, when="pre-flight", outcome="no rank starts training")
    if all(f.user_error for f in failures):
        raise ValueError(message)
    raise HealthCheckError(message)
