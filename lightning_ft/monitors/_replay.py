"""Which steps an earlier attempt of the run already reached, so that the monitors log each global step once.

After a restart the steps between the checkpoint and the point where the stopped attempt died are computed again.
The monitors do not log them a second time (TensorBoard would draw the line back over the old points); the highest
step an earlier attempt recorded in the event log marks the end of that replayed range.
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning_ft.events import EventLog, get_event_log, read_events
from lightning_ft.monitors.run_history import highest_step

_SEEN: weakref.WeakKeyDictionary[EventLog, int] = weakref.WeakKeyDictionary()


def replayed_through(trainer: Any) -> int:
    """The highest global step an earlier attempt of this run recorded (-1 when none, or without an event log).

    Not collective; call it on rank 0, which logs. The log is read once per attempt and shared by the monitors.
    """
    log = get_event_log(trainer, open_if_missing=False)
    if log is None:
        return -1
    if log not in _SEEN:
        _SEEN[log] = highest_step(read_events(log.path.parent), log.run_id, before_attempt=log.attempt)
    return _SEEN[log]
