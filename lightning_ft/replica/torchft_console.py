"""torchft's console output in the replica mode: its INFO lines off unless asked for, a failed collective said once.

torchft logs on two sides. Its Rust part (the group's manager server, the lighthouse) prints through ``fern`` to
stderr at the level of ``RUST_LOG``, read once, when ``torchft._torchft`` is imported; torchft's default is INFO:
every quorum, vote and heartbeat change, two to ten lines per step, most of a group's console. Its Python ``Manager``
logs a failed collective (a lost group's all-reduce: ``Connection reset by peer``) as an ERROR with the traceback,
on every survivor, at every loss that it handles itself (the step is discarded), and warns at each reconfiguration
on a machine without NCCL's flight recorder.

Here, by default: torchft is imported with ``RUST_LOG=warn`` when the user has not set ``RUST_LOG`` (the process
environment is left as it was; :func:`lightning_ft._torchft_native.import_torchft`, which the strategy's replica seam and
``lightning-ft lighthouse`` call first); for a fit, :class:`TorchftConsole` drops the traceback of a failed collective from
torchft's ``torchft.manager`` logger and keeps its text for lightning-ft's own line
(:mod:`~lightning_ft.replica.replica_sync`: one line per lost group on each survivor), and drops the flight-recorder
warning. ``LIGHTNING_FT_TORCHFT_LOGS=1`` keeps all of torchft's output as torchft prints it; ``RUST_LOG=info`` keeps
its Rust lines only. The same applies to ``lightning-ft lighthouse``.
"""

from __future__ import annotations

import logging
import re

from lightning_ft import _compat
from lightning_ft._torchft_native import torchft_logs_wanted

__all__ = ["TorchftConsole", "short_error"]

_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_GLOO_ADVICE = re.compile(r"\s*(?:This is typically caused|Check the logs of the remote worker).*$", re.DOTALL)


def short_error(text: str) -> str:
    """A collective's error in a few words: gloo's source location and its advice dropped
    (``Read error [127.0.0.1]:40644: Connection reset by peer``)."""
    first = str(text).strip()
    first = _GLOO_SOURCE.sub("", first)
    first = _GLOO_ADVICE.sub("", first).strip().rstrip(".")
    return " ".join(first.split())[:200] or "unknown error"


class TorchftConsole(logging.Filter):
    """A filter on torchft's ``torchft.manager`` logger for one fit: drops what lightning-ft says itself.

    :meth:`install` adds it (nothing when ``LIGHTNING_FT_TORCHFT_LOGS=1``), :meth:`uninstall` removes it (teardown).
    :attr:`failure` holds the last failed collective's error in a few words until :meth:`take_failure` reads it.
    Thread-safe enough for its use: torchft logs from the training thread and its quorum thread; a record's fields
    are set before the filter runs, and the one attribute written is replaced whole.
    """

    def __init__(self) -> None:
        super().__init__(name="lightning-ft")
        self.failure: str | None = None
        self._logger = logging.getLogger(_compat.TORCHFT_MANAGER_LOGGER)
        self._installed = False

    def install(self) -> TorchftConsole:
        if not self._installed and not torchft_logs_wanted():
            self._logger.addFilter(self)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            self._logger.removeFilter(self)
            self._installed = False

    def take_failure(self) -> str | None:
        """The last failed collective's error since the previous call (``None``: none)."""
        failure, self.failure = self.failure, None
        return failure

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(text in message for text in _compat.TORCHFT_FAILED_COLLECTIVE_MESSAGES):
            error = record.exc_info[1] if record.exc_info and record.exc_info[1] is not None else message
            self.failure = short_error(str(error))
            return False
        return not any(text in message for text in _compat.TORCHFT_NOISE_MESSAGES)
