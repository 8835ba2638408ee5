"""How long a world change kept a run from training, in parts: detection, rendezvous, start-up, load, first step.

Every timestamp comes from the run's own records, so the numbers hold for a failure, a preemption, a shrink and a
grow alike, under torchrun or a scheduler:

- the previous world's *last step*: the latest ``last_step_time`` in its ``attempt_end`` events (each rank of an
  attempt that stops with an exception or a signal writes one), else the time of its last ``progress`` or
  ``first_step`` event (then good to ``log_every_n_steps``; a ``progress`` line's own ``last_step_time`` where it has
  one, since one written by the hang watchdog comes long after its step);
- its *stop*: the earliest ``attempt_end`` of that attempt (the first rank to notice; absent when every process was
  killed outright);
- this attempt's process start (rank 0), the checkpoint load's start and end, and the end of its first step.

:func:`resume_timing` turns them into the fields of the ``resumed`` event. For a grow, the previous world did not
fail: torchrun stopped it when the new node arrived, so the clock starts at its last step, and the new node's own
start-up before that is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_STEP_EVENTS = ("progress", "first_step")


@dataclass(frozen=True)
class PreviousWorld:
    """When the world before this attempt last trained, and when it stopped (Unix seconds; ``None``: unknown)."""

    attempt: int | None
    """The attempt that trained last before this one."""
    last_step_time: float | None
    """End of its last completed optimizer step."""
    stop_time: float | None
    """When its first rank noticed the stop (its earliest ``attempt_end``)."""


def previous_world(events: list[dict[str, Any]], *, run_id: str, attempt: int) -> PreviousWorld:
    """The latest attempt of ``run_id`` before ``attempt`` that trained at least one step (or wrote an
    ``attempt_end``), read from ``events`` (every rank's, as :func:`lightning_ft.events.read_events` returns)."""
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        number = event.get("attempt")
        if event.get("run_id") == run_id and isinstance(number, int) and number < attempt:
            by_attempt.setdefault(number, []).append(event)
    for number in sorted(by_attempt, reverse=True):
        mine = by_attempt[number]
        ends = [e for e in mine if e.get("event") == "attempt_end"]
        step_times = [e["last_step_time"] for e in ends if isinstance(e.get("last_step_time"), (int, float))]
        if not step_times:
            # A progress line written at a failure or a hang names when its step ended (last_step_time).
            step_times = [e.get("last_step_time") or e["time"] for e in mine if e.get("event") in _STEP_EVENTS]
        if step_times or ends:
            return PreviousWorld(
                attempt=number,
                last_step_time=max(step_times) if step_times else None,
                stop_time=min(e["time"] for e in ends) if ends else None,
            )
    return PreviousWorld(attempt=None, last_step_time=None, stop_time=None)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(end - start, 0.0)


def resume_timing(
    previous: PreviousWorld,
    *,
    process_start_time: float,
    load_start_time: float,
    load_end_time: float,
    first_step_time: float | None,
) -> dict[str, float | None]:
    """The timing fields of the ``resumed`` event, in seconds (``None`` where a timestamp is unknown):

    - ``detection_s``: previous world's last step -> its stop was noticed;
    - ``rendezvous_s``: that -> this attempt's processes started (stopping the old workers, the launcher's rendezvous,
      starting the new ones);
    - ``startup_s``: process start -> checkpoint load begins (imports, process group, model set-up);
    - ``load_s``: reading the checkpoint and putting it in place;
    - ``first_step_s``: load done -> first optimizer step done (data set-up included);
    - ``downtime_s``: previous world's last step -> first step here, the sum of the above when all are known.
    """
    return {
        "detection_s": _span(previous.last_step_time, previous.stop_time),
        "rendezvous_s": _span(previous.stop_time, process_start_time),
        "startup_s": _span(process_start_time, load_start_time),
        "load_s": _span(load_start_time, load_end_time),
        "first_step_s": _span(load_end_time, first_step_time),
        "downtime_s": _span(previous.last_step_time, first_step_time),
    }
