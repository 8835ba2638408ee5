"""When ``ElasticFT3D`` restores a checkpoint's module and callback state: Lightning's order wherever the mode allows it.

Lightning's ``Trainer`` restores a checkpoint in two parts. The first (``_restore_modules_and_callbacks``: the load,
then the LightningModule's ``on_load_checkpoint`` and weights, the datamodule's and every callback's state) runs before
``Strategy.setup`` when the strategy's ``restore_checkpoint_after_setup`` is False (``DDPStrategy``), else after
``on_fit_start`` (``ModelParallelStrategy``, FSDP, DeepSpeed). The second (``restore_training_state``: precision
plugin, loops, optimizers, LR schedulers) always runs after ``on_fit_start``. Callbacks rely on the first coming
before ``on_fit_start``: ``BaseFinetuning`` (``BackboneFinetuning``) re-adds the param groups it added before the
optimizer state is loaded, so a resume after its unfreeze epoch loads; ``StochasticWeightAveraging`` keeps its
averaged model and counts; any callback may read its restored state there.

``ElasticFT3D.restore_checkpoint_after_setup`` is False in every mode, so Lightning hands the first part, and the
stage's ``ckpt_path``, to the strategy before ``setup``. :class:`RestoreOrder` patches the connector's
``_restore_modules_and_callbacks`` for the run and runs it

- right there in data parallel (no parameter is a DTensor): as under ``DDPStrategy``, the module's state is put back
  before the module is wrapped in DDP and before ``configure_optimizers``;
- at the end of ``ElasticFT3D.setup`` with DTensor or pipeline parameters, whose state is loaded in place into the
  sharded module and optimizers that exist only then: still before ``on_fit_start``, so every callback reads its
  restored state there as under ``DDPStrategy``. The optimizer state is loaded in place with the module's there, also
  before ``on_fit_start`` (docs/strategy.md, "Restore order").

The second part stays Lightning's in every mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_ft import _compat

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RestoreOrder"]


class RestoreOrder:
    """Runs Lightning's restore of module and callback state when the run's parallel mode can take it (see the module
    docstring). One per run; :meth:`install` in ``setup_environment``, :meth:`uninstall` at ``teardown``."""

    def __init__(self) -> None:
        self._patch: _compat.Patch | None = None
        self._deferred: tuple[Callable[..., None], Any, Any] | None = None

    def install(self, trainer: pl.Trainer, *, restores_before_setup: Callable[[], bool]) -> None:
        """Patch the trainer's checkpoint connector for this stage (idempotent).

        ``restores_before_setup()`` is asked when Lightning hands the restore over (after ``configure_model``, on
        every rank, collective where it prepares the strategy for a load): True runs it there, False keeps it for
        :meth:`after_setup`.
        """
        self._deferred = None
        if self._patch is not None:
            return

        def restore(original: Callable[..., None], checkpoint_path: Any, weights_only: Any) -> None:
            if restores_before_setup():
                original(checkpoint_path, weights_only)
            else:
                self._deferred = (original, checkpoint_path, weights_only)

        self._patch = _compat.restore_modules_and_callbacks_patch(
            trainer, restore, name="lightning-ft restore order"
        ).install()

    def after_setup(self) -> None:
        """From the end of ``ElasticFT3D.setup`` (every rank, collective: the load): the restore kept for after the
        set-up, if any."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            original, checkpoint_path, weights_only = deferred
            original(checkpoint_path, weights_only)

    def uninstall(self) -> None:
        self._deferred = None
        if self._patch is not None:
            self._patch.undo()
            self._patch = None
