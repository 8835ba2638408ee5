"""``MemoryTier``: the configuration of the in-memory checkpoint tier (``ElasticFT3D(memory_tier=...)``).

The durable tier is the ``ModelCheckpoint`` folder, saved when ``ModelCheckpoint`` decides. The memory tier keeps the
newest state of every rank in node-local memory (files on ``/dev/shm``, which outlive the process but not the machine)
and, with ``peer_copy=True``, a second copy on a partner node; it is saved every ``every_n_train_steps`` steps and used
at resume when it is newer than the durable tier and every rank can restore from it (docs/checkpointing.md, "Tiers").
This module holds the user's choice and the rule that resolves its folder; the strategy
(:mod:`lightning_ft.strategy.memory_checkpoints`) does the work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MEMORY_DIR_ENV", "MemoryTier"]

MEMORY_DIR_ENV = "LIGHTNING_FT_MEMORY_DIR"
"""Environment variable that overrides :attr:`MemoryTier.dirpath` (one folder per simulated node in tests)."""


@dataclass(kw_only=True, frozen=True)
class MemoryTier:
    """Keep each rank's newest state in node-local memory, and a copy on a partner node, every few steps.

    Off unless given: ``ElasticFT3D(memory_tier=None)`` (the default) saves only where ``ModelCheckpoint`` does.

    Example::

        from lightning_ft import ElasticFT3D, MemoryTier

        strategy = ElasticFT3D(memory_tier=MemoryTier(every_n_train_steps=10))

    Raises:
        TypeError: a field of the wrong type.
        ValueError: ``every_n_train_steps`` below 1, or an empty ``dirpath``.
    """

    every_n_train_steps: int = 10
    """Optimizer steps between two memory saves (as ``ModelCheckpoint(every_n_train_steps=...)``): the state after
    every step whose ``global_step`` is a multiple of it. At most this many steps are lost when a process or a node
    fails."""

    dirpath: str | os.PathLike[str] = "/dev/shm"
    """Node-local folder the copies live in, under ``<dirpath>/lightning-ft/<run_id>-<key>/`` (``<key>``: a digest of
    the checkpoint folders and the model's identity, so that another experiment never reads this run's copies); a
    memory-backed filesystem (tmpfs) is what makes the tier fast. The environment variable
    ``LIGHTNING_FT_MEMORY_DIR`` overrides it."""

    peer_copy: bool = True
    """Also keep each rank's copy on the rank with the same local rank on the next node, so that the state of a lost
    node survives on another (needs 2 or more nodes; with one node only the local copy is kept)."""

    def __post_init__(self) -> None:
        steps = self.every_n_train_steps
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise TypeError(f"MemoryTier(every_n_train_steps={steps!r}): must be an int (optimizer steps)")
        if steps < 1:
            raise ValueError(f"MemoryTier(every_n_train_steps={steps}): must be >= 1 (optimizer steps between saves)")
        if not isinstance(self.dirpath, (str, os.PathLike)):
            raise TypeError(f"MemoryTier(dirpath={self.dirpath!r}): must be a str or os.PathLike folder")
        if not str(self.dirpath):
            raise ValueError("MemoryTier(dirpath=''): must name a node-local folder (default '/dev/shm')")
        if not isinstance(self.peer_copy, bool):
            raise TypeError(f"MemoryTier(peer_copy={self.peer_copy!r}): must be True or False")

    def resolved_dirpath(self) -> Path:
        """The folder in force: ``LIGHTNING_FT_MEMORY_DIR`` when set, else :attr:`dirpath`."""
        return Path(os.environ.get(MEMORY_DIR_ENV) or self.dirpath)
