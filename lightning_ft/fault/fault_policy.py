"""Settings for preemption, hang detection, the pre-flight and periodic health checks and the eviction cooldown.

:class:`FaultPolicy` is the ``fault=`` argument of :class:`lightning_ft.ElasticFT3D`; ``fault=None`` turns all of it
off. It holds only validated settings: the signal handlers, the hang watchdog and the health checks in
``lightning_ft.fault`` read them.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from typing import Any

from lightning_ft.stop import EXIT_CODE_TEMPFAIL

# torchrun (torch.distributed.elastic) sends SIGTERM to its workers on shutdown and SIGKILLs them 30 s later
# (`PContext.close(timeout=30)`, `LocalElasticAgent(shutdown_timeout=30)`); the preemption checkpoint must fit inside.
TORCHRUN_SHUTDOWN_TIMEOUT_S = 30.0

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}

HEALTH_CHECK_ACTIONS = ("log", "checkpoint_and_stop", "evict")
"""What a failed periodic health check does; see :attr:`FaultPolicy.health_check_action`."""


@dataclass(kw_only=True, frozen=True)
class FaultPolicy:
    """How a run reacts to preemption signals, hangs and failed health checks.

    Example::

        import signal
        from lightning_ft import ElasticFT3D, FaultPolicy

        strategy = ElasticFT3D(fault=FaultPolicy(preemption_signals=("SIGTERM", signal.SIGUSR2), grace_s=25.0))

    Or in a LightningCLI config::

        trainer:
          strategy:
            class_path: lightning_ft.ElasticFT3D
            init_args:
              fault:
                class_path: lightning_ft.FaultPolicy
                init_args: {preemption_signals: [SIGTERM, SIGUSR1], hang_timeout_s: 300}
    """

    preemption_signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
    """Signals that mean "save a checkpoint and stop": ``signal.Signals`` members, names (``"SIGTERM"`` or ``"TERM"``)
    or numbers. SIGTERM is what torchrun, Kubernetes and SLURM send first; SLURM's ``--signal=USR1@<s>`` sends
    SIGUSR1 ahead of time. Empty: no preemption handling."""

    exit_code: int = EXIT_CODE_TEMPFAIL
    """Process exit code after a preemption checkpoint, 1-255. Non-zero, so torchrun counts the exit as a failure and
    restarts the worker group (while ``--max-restarts`` allow), and a scheduler does not record the job as done; an
    exit 0 reads as "training finished". 75 is ``EX_TEMPFAIL``: a temporary failure, to be retried."""

    grace_s: float = 20.0
    """Seconds, after the signal, for the preemption checkpoint to commit before the process exits anyway. Must stay
    below torchrun's shutdown timeout (30 s, after which it sends SIGKILL)."""

    hang_timeout_s: float = 600.0
    """Seconds without a completed training step (after the first) before the watchdog reports a hang."""

    first_step_timeout_s: float = 1800.0
    """Seconds allowed for the first step of each attempt (compilation, data warm-up, restore); at least
    ``hang_timeout_s``."""

    health_checks: bool = True
    """Run the pre-flight health checks at setup."""

    health_check_every_n_steps: int | None = 1000
    """Run the periodic health checks (collective round trip and bus bandwidth against the pre-flight measurement,
    NVML memory errors and hardware slowdowns) every this many optimizer steps, on every rank at the same step (when
    ``trainer.global_step`` is a multiple of it). ``None``: only the pre-flight checks. Independent of
    ``health_checks``: without the pre-flight checks, the first periodic check measures the collective baseline."""

    health_check_action: str = "log"
    """What every rank does when a periodic check fails on any rank: ``"log"`` (a ``health_check_failed`` event and a
    warning naming the ranks and checks; training goes on), ``"checkpoint_and_stop"`` (commit ``preempt-step=<N>``
    and exit with ``exit_code`` on every rank, so that the scheduler can place the job elsewhere) or ``"evict"`` (the
    node of each failing rank leaves the job through its torchrun agent and the others go on without it, or with a
    waiting spare: :func:`~lightning_ft.fault.eviction.evict_node`, docs/fault-tolerance.md "Eviction and warm
    spares"; refused at set-up outside torchrun or with ``--max-restarts=0``)."""

    health_check_slowdown: float = 5.0
    """The collective check fails when the round trip is more than this many times, or the bus bandwidth less than
    one over this many times, what the pre-flight check measured, in two measurements in a row (a finite ratio > 1).
    5.0 is above the noise measured on gloo on a host loaded 5-8 times over (at most 4.7x confirmed in 60 checks);
    a link that fell back from InfiniBand or NVLink to TCP or PCIe is 10x or more slower (docs/fault-tolerance.md,
    "Periodic health checks")."""

    eviction_cooldown_s: float = 3600.0
    """Seconds an evicted node refuses to rejoin the job (its health record says unhealthy until then). Read by
    ``StragglerMonitor(action="evict")``, ``ThermalMonitor(action="evict")`` and every other eviction. 0: a
    restarted node may rejoin at once (the record still tells why it was evicted)."""

    refuse_unhealthy_nodes: bool = True
    """At setup, a rank whose node's health record is in its cooldown refuses to join: its workers leave through
    their torchrun agent, and the others restart without it. ``False``: records are written but never enforced."""

    def __post_init__(self) -> None:
        # Frozen dataclass: normalizing a field needs object.__setattr__.
        object.__setattr__(self, "preemption_signals", _normalize_signals(self.preemption_signals))
        if isinstance(self.exit_code, bool) or not isinstance(self.exit_code, int):
            raise TypeError(f"FaultPolicy(exit_code={self.exit_code!r}): must be an int")
        if not 1 <= self.exit_code <= 255:
            raise ValueError(
                f"FaultPolicy(exit_code={self.exit_code}): must be in 1..255; 0 would make torchrun and the scheduler"
                " treat the preempted run as finished"
            )
        cooldown = self.eviction_cooldown_s
        if isinstance(cooldown, bool) or not isinstance(cooldown, (int, float)):
            raise TypeError(f"FaultPolicy(eviction_cooldown_s={cooldown!r}): must be a number of seconds")
        if not 0 <= cooldown < float("inf"):
            raise ValueError(f"FaultPolicy(eviction_cooldown_s={cooldown!r}): must be >= 0 and finite seconds")
        object.__setattr__(self, "eviction_cooldown_s", float(cooldown))
        if not isinstance(self.refuse_unhealthy_nodes, bool):
            raise TypeError(
                f"FaultPolicy(refuse_unhealthy_nodes={self.refuse_unhealthy_nodes!r}): must be True or False"
            )
        for name in ("grace_s", "hang_timeout_s", "first_step_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"FaultPolicy({name}={value!r}): must be a number of seconds")
            if not value > 0:
                raise ValueError(f"FaultPolicy({name}={value!r}): must be > 0 seconds")
            object.__setattr__(self, name, float(value))
        if self.grace_s >= TORCHRUN_SHUTDOWN_TIMEOUT_S:
            raise ValueError(
                f"FaultPolicy(grace_s={self.grace_s}): must be below {TORCHRUN_SHUTDOWN_TIMEOUT_S:g} s, torchrun's"
                " shutdown timeout, after which it kills the workers with SIGKILL mid-checkpoint"
            )
        if self.first_step_timeout_s < self.hang_timeout_s:
            raise ValueError(
                f"FaultPolicy(first_step_timeout_s={self.first_step_timeout_s}): must be >= hang_timeout_s="
                f"{self.hang_timeout_s}; the first step also compiles, warms up data loading and restores"
            )
        if not isinstance(self.health_checks, bool):
            raise TypeError(f"FaultPolicy(health_checks={self.health_checks!r}): must be True or False")
        every = self.health_check_every_n_steps
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int):
                raise TypeError(f"FaultPolicy(health_check_every_n_steps={every!r}): must be an int or None")
            if every < 1:
                raise ValueError(
                    f"FaultPolicy(health_check_every_n_steps={every}): must be >= 1 optimizer steps, or None for no"
                    " periodic health checks"
                )
        if self.health_check_action not in HEALTH_CHECK_ACTIONS:
            raise ValueError(
                f"FaultPolicy(health_check_action={self.health_check_action!r}): must be one of {HEALTH_CHECK_ACTIONS}"
            )
        slowdown = self.health_check_slowdown
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)):
            raise TypeError(f"FaultPolicy(health_check_slowdown={slowdown!r}): must be a number (a ratio)")
        if not (slowdown > 1.0 and math.isfinite(slowdown)):
            raise ValueError(
                f"FaultPolicy(health_check_slowdown={slowdown!r}): must be a finite ratio > 1 to the pre-flight"
                " measurement (at or below 1 every check would fail on noise)"
            )
        object.__setattr__(self, "health_check_slowdown", float(slowdown))


def _normalize_signals(value: Any) -> tuple[signal.Signals, ...]:
    if isinstance(value, (str, int, signal.Signals)):
        value = (value,)
    try:
        items = list(value)
    except TypeError:
        raise TypeError(
            f"FaultPolicy(preemption_signals={value!r}): must be a sequence of signals, names or numbers"
        ) from None
    signals = []
    for item in items:
        signals.append(_to_signal(item, value))
    if len(set(signals)) != len(signals):
        raise ValueError(f"FaultPolicy(preemption_signals={value!r}): a signal is listed twice")
    return tuple(signals)


def _to_signal(item: Any, value: Any) -> signal.Signals:
    if isinstance(item, signal.Signals):
        sig = item
    elif isinstance(item, str):
        name = item.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise ValueError(
                f"FaultPolicy(preemption_signals={value!r}): {item!r} is not a signal name on this platform"
            ) from None
    elif isinstance(item, int) and not isinstance(item, bool):
        try:
            sig = signal.Signals(item)
        except ValueError:
            raise ValueError(f"FaultPolicy(preemption_signals={value!r}): {item} is not a signal number") from None
    else:
        raise TypeError(f"FaultPolicy(preemption_signals={value!r}): {item!r} is not a signal, name or number")
    if sig in _UNCATCHABLE:
        raise ValueError(f"FaultPolicy(preemption_signals={value!r}): {sig.name} cannot be caught by a process")
    return sig
