"""Teardown that is safe at every stage of a failed set-up and never hides the error that stopped the run.

Lightning calls ``Strategy.teardown`` at the end of a run and also while it handles an exception raised anywhere
between the launcher and the last step. At that point any part of the set-up may be missing: the module may not be
attached to the trainer yet (a launch that failed), the event log, the checkpoint writer or the tracker may not
exist. An error raised from teardown then would be printed after the user's own error ("During handling of the above
exception, another exception occurred"), look like the cause, and skip the rest of Lightning's teardown (loggers,
signal handlers). :class:`TeardownSteps` runs every step of a teardown whatever happens to the others; while a run
fails, their errors are logged and the run's own exception is the one that propagates.

When another process of the run dies (SIGKILL, a lost node), every survivor's next collective fails, and so does the
teardown step that waits for the checkpoint in flight: expected, and not a failure of lightning-ft or of this process.
Such an error (:func:`peer_loss` recognises it) is reported in one line that says so and what became of the save,
without a traceback; the dead process's own output says why it died.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

# gloo: "Connection closed by peer [127.0.0.1]:9358", "Connection reset by peer [10.0.0.2]:41234"; TCPStore and plain
# sockets: "Connection reset by peer", "Broken pipe".
_CONNECTION_LOST = re.compile(
    r"connection (?P<how>closed|reset) by peer(?: \[(?P<host>[^\]]+)\](?::(?P<port>\d+))?)?|(?P<pipe>broken pipe)",
    re.IGNORECASE,
)
# NCCL: a peer's process exited, or the communicator was aborted after another rank failed.
_GROUP_FAILED = re.compile(r"remote process exited|communicator was aborted|NCCL communicator", re.IGNORECASE)
_DIST_ERRORS = tuple(getattr(dist, name) for name in ("DistNetworkError", "DistBackendError") if hasattr(dist, name))


def peer_loss(error: BaseException, *, rank: int, world_size: int) -> str | None:
    """Why ``error`` says another process of the group went away, for a message ("connection closed by rank 1 at
    127.0.0.1:9358", "the process group failed: ..."); ``None`` when it says nothing of the kind.

    Follows ``__cause__`` (an error raised from a collective's), never ``__context__``: a teardown error's context is
    the run's own failure. With two processes the peer can only be the other rank, which is then named.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        found = _CONNECTION_LOST.search(text)
        if found is not None:
            if found["pipe"]:
                return "broken pipe to a peer"
            who = f"rank {1 - rank}" if world_size == 2 and rank in (0, 1) else "a peer"
            where = f" at {found['host']}" + (f":{found['port']}" if found["port"] else "") if found["host"] else ""
            return f"connection {found['how'].lower()} by {who}{where}"
        if _GROUP_FAILED.search(text) or isinstance(current, _DIST_ERRORS):
            first_line = text.strip().splitlines()[0] if text.strip() else type(current).__name__
            return f"the process group failed: {first_line[:200]}"
        current = current.__cause__
    return None


def attached_trainer(module: Any) -> pl.Trainer | None:
    """The trainer ``module`` is attached to, or ``None`` (no module, or Lightning has not attached it yet)."""
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # LightningModule.trainer raises until the Trainer attaches itself in `_run`
        return None


def remove_callback(trainer: pl.Trainer | None, callback: Any) -> None:
    """Remove ``callback`` from ``trainer.callbacks`` if both exist and it is there."""
    if trainer is not None and callback is not None and callback in trainer.callbacks:
        trainer.callbacks.remove(callback)


class TeardownSteps:
    """Runs each step of a teardown even when an earlier one failed, then reports the errors once.

    Args:
        failure: the exception the run is failing with (what ``Strategy.on_exception`` received), or ``None`` when
            the run ends normally.
        rank: this process's global rank, for the message about a lost peer.
        world_size: the number of processes of the run.

    With ``failure``, :meth:`finish` logs every step's error and raises nothing, so ``failure`` stays the error the
    user sees last: an error that says another process went away (:func:`peer_loss`) as one warning line that says so
    (and, where the step gave one, what it means: which save is lost, which checkpoint is the last committed), any other
    with its traceback. Without ``failure``, :meth:`finish` raises the first error (a failed background save, say) and
    logs the others.

    Example::

        steps = TeardownSteps(failure=self._failure)
        steps.run(writer.close, "waiting for the checkpoint in flight")
        steps.run(patch.undo, "undoing the auto-resume patch")
        steps.finish()
    """

    def __init__(self, *, failure: BaseException | None, rank: int = 0, world_size: int = 1) -> None:
        self.failure = failure
        self.rank = rank
        self.world_size = world_size
        self.errors: list[tuple[str, Exception]] = []
        self._outcomes: dict[int, Callable[[], str]] = {}

    def run(self, step: Callable[[], object], what: str, *, after_peer_loss: Callable[[], str] | None = None) -> None:
        """Call ``step``; keep an ``Exception`` it raises (``what`` says what it was doing) and carry on.

        ``after_peer_loss``: called (once, by :meth:`finish`) when the step failed because another process went
        away; returns what that means for the user, a clause of the one-line message ("that save ... is not
        committed; the last committed checkpoint is ...").
        """
        try:
            step()
        except Exception as err:  # noqa: BLE001 - kept and reported by finish(); the other steps still run
            self.errors.append((what, err))
            if after_peer_loss is not None:
                self._outcomes[id(err)] = after_peer_loss

    def finish(self) -> None:
        """Report the errors of the steps: raise the first one, unless the run is already failing (see the class)."""
        if not self.errors:
            return
        if self.failure is not None:
            for what, err in self.errors:
                lost = peer_loss(err, rank=self.rank, world_size=self.world_size)
                if lost is not None:
                    log.warning("%s", self._peer_loss_line(lost, what, err))
                    continue
                log.error(
                    "lightning-ft: teardown failed while %s (%s: %s); the error that stopped the run follows",
                    what,
                    type(err).__name__,
                    err,
                    exc_info=err,
                )
            return
        for what, err in self.errors[1:]:
            log.error("lightning-ft: teardown also failed while %s", what, exc_info=err)
        raise self.errors[0][1]

    def _peer_loss_line(self, lost: str, what: str, err: Exception) -> str:
        line = f"lightning-ft: rank {self.rank} lost a peer ({lost}) while {what}"
        outcome = self._outcomes.get(id(err))
        if outcome is not None:
            try:
                line += f"; {outcome()}"
            except Exception as e:  # noqa: BLE001 - the line is still worth printing without it
                line += f" (what became of the save is unknown: {type(e).__name__}: {e})"
        return (
            f"{line}. Expected when another process of the run dies: the failure is that process's (its own output"
            " says why), not this one's"
        )
