"""The user's ``CheckpointIO`` plugin under ``ElasticFT3D``: which of its methods lightning-ft calls.

Lightning gives a ``Trainer(plugins=[MyCheckpointIO()])`` (or ``strategy.checkpoint_io = ...``) to the strategy.
``DDPStrategy`` then reads every checkpoint through the plugin's ``load_checkpoint`` and writes every one through its
``save_checkpoint``. Libraries do this: darts gives its Trainer a plugin that allows darts' classes while loading.
ElasticFT3D writes its checkpoints itself (in the background, committed, with checksums), and reads them so:

- A plugin with a ``load_checkpoint`` of its own (not ``TorchCheckpointIO``'s, seen through wrappers such as
  ``AsyncCheckpointIO``) reads each checkpoint file that Lightning asks to load: a lightning-ft file or another
  strategy's ``.ckpt``. It is called as ``DDPStrategy`` calls it: ``load_checkpoint(path, weights_only=...)``.
  lightning-ft's checks stay around it. Only a committed file reaches it. What it returns is compared with the
  checksums recorded at the save: a damaged file is refused, an edited one is said once. Then lightning-ft's own
  per-process state (RNG states, the samplers' positions) is applied, so the resume stays exact.
- A folder checkpoint (sharded or pipeline state) is read by lightning-ft: a plugin reads files. The objects a folder
  stores follow torch's allowed globals, or ``weights_only=False``.
- A plugin's own ``save_checkpoint`` and ``remove_checkpoint`` are not called (said once, at set-up): the file at a
  checkpoint path is the ``torch.save`` file ``TorchCheckpointIO`` writes, plus lightning-ft's record.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ft import _compat
from lightning_ft.checkpoint.internal import file_reader_scope

__all__ = ["file_reader", "reading_through", "warn_unused_writes"]


# How DDPStrategy of the installed Lightning calls the plugin: with `weights_only` from Lightning 2.6 on.
_STRATEGY_PASSES_WEIGHTS_ONLY = "weights_only" in inspect.signature(Strategy.load_checkpoint).parameters


def _innermost(plugin: Any) -> Any:
    """The plugin that does the work: Lightning's wrappers (``AsyncCheckpointIO``) pass their calls on."""
    for _ in range(16):
        inner = _compat.wrapped_checkpoint_io(plugin)
        if inner is None:
            return plugin
        plugin = inner
    return plugin


def _own(plugin: Any, method: str) -> bool:
    """Whether ``plugin`` (a ``CheckpointIO``) does ``method`` its own way rather than as ``TorchCheckpointIO``."""
    return getattr(type(_innermost(plugin)), method, None) is not getattr(TorchCheckpointIO, method)


def file_reader(strategy: Any, weights_only: bool | None) -> Callable[[Path], Any] | None:
    """How the strategy's user ``CheckpointIO`` reads a checkpoint file, as ``DDPStrategy.load_checkpoint`` calls it
    (``weights_only`` as Lightning gave it to the stage); ``None`` when the plugin loads as ``TorchCheckpointIO``
    does (lightning-ft's own rule applies: ``weights_only`` plus the classes Lightning checkpoints commonly hold)."""
    plugin = strategy.checkpoint_io
    if not _own(plugin, "load_checkpoint"):
        return None

    def read(path: Path) -> Any:
        if not _STRATEGY_PASSES_WEIGHTS_ONLY:  # Lightning 2.5: plugins written for it may not take the argument
            return plugin.load_checkpoint(path)
        return plugin.load_checkpoint(path, weights_only=weights_only)

    return read


@contextmanager
def reading_through(strategy: Any, weights_only: bool | None) -> Iterator[None]:
    """Within it, the checkpoint files of a load are read by :func:`file_reader`'s plugin, if any."""
    with file_reader_scope(file_reader(strategy, weights_only)):
        yield


_said: set[type] = set()


def warn_unused_writes(strategy: Any) -> None:
    """Say once per plugin class (rank 0) that the user's ``CheckpointIO`` writes and removes nothing here: its own
    ``save_checkpoint`` / ``remove_checkpoint`` are not called."""
    plugin = _innermost(strategy.checkpoint_io)
    own = [m for m in ("save_checkpoint", "remove_checkpoint") if _own(plugin, m)]
    if not own or type(plugin) in _said:
        return
    _said.add(type(plugin))
    name = type(plugin).__qualname__
    methods = " and ".join(f"{name}.{m}" for m in own)
    reads = ""
    if _own(plugin, "load_checkpoint"):
        reads = f" {name}.load_checkpoint still reads every checkpoint file, as under DDPStrategy."
    rank_zero_warn(
        f"lightning-ft: ElasticFT3D writes and removes its checkpoints itself, so {methods}"
        f" {'are' if len(own) > 1 else 'is'} not called. Each checkpoint file is the torch.save file"
        f" TorchCheckpointIO writes, plus lightning-ft's record.{reads}"
    )
