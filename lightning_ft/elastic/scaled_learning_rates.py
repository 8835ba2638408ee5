"""The elastic learning-rate scale, applied in the optimizer itself, so that what users read is what it steps with.

:class:`ScaledLearningRates` keeps every param group's ``lr`` at the run's own rate (what the LR schedulers and the
user's code set) times :meth:`LRScale.at` of the step. Lightning's ``LearningRateMonitor``, TensorBoard,
``optimizer.param_groups`` and ``scheduler.get_last_lr()`` therefore show the rate the next step uses. LR schedulers
keep computing the unscaled schedule: the LightningModule's ``lr_scheduler_step`` hook, through which Lightning steps
every scheduler, is wrapped (a :class:`~lightning_ft._compat.Patch`, undone at :meth:`detach`) so that a scheduler
reads and writes unscaled rates. A rate set by other code between steps (a manual warm-up in the LightningModule,
say) is taken as an unscaled rate and scaled at the next :meth:`apply`. A scheduler stepped by hand (manual
optimization) while a scale other than 1 is in force reads the scaled rate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_ft import _compat
from lightning_ft.elastic.lr_scale import LRScale


class _Group:
    """What this object knows of one param group: the rate it wrote there, and that rate unscaled."""

    __slots__ = ("group", "unscaled", "written")

    def __init__(self, group: dict[str, Any], unscaled: float) -> None:
        self.group, self.unscaled, self.written = group, unscaled, group["lr"]

    def read_unscaled(self) -> float:
        lr = self.group["lr"]
        if lr != self.written:  # set by someone else since: that is the run's own rate now
            self.unscaled = lr
        return self.unscaled

    def write(self, scale: float) -> None:
        self.group["lr"] = self.written = self.unscaled * scale


class ScaledLearningRates:
    """Every optimizer's rates are the run's own rates times ``scale.at(global_step)``.

    Calling contract: :meth:`attach` once the optimizers exist and hold their loaded state (``on_train_start``), on
    every rank; :meth:`apply` before each optimizer step and after it (for the next one); :meth:`detach` at teardown.
    Not thread-safe; runs in the training loop's thread.

    Example::

        rates = ScaledLearningRates()
        rates.scale.resume(decision, step=1200)
        rates.attach(trainer.optimizers, module=trainer.lightning_module, saved_scale=1.0)
        rates.apply(trainer.global_step)
    """

    def __init__(self) -> None:
        self.scale = LRScale()
        """The factor as a function of the step (restored from, and saved into, checkpoint metadata)."""
        self.replica = LRScale()
        """The replica mode's factor of the live groups (:mod:`lightning_ft.elastic.replica_policy`), relative to the
        full membership; multiplies :attr:`scale`. 1.0 without replica groups."""
        self.applied = 1.0
        """The factor the optimizers' rates carry now."""
        self._groups: list[_Group] = []
        self._patches: list[_compat.Patch] = []

    def attach(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        *,
        module: Any = None,
        saved_scale: float = 1.0,
    ) -> None:
        """Take over ``optimizers`` (Lightning-wrapped or not), whose rates now carry the factor ``saved_scale`` (the
        ``lr_scale`` of the checkpoint their state came from; 1.0 for a fresh run), and wrap ``module``'s
        ``lr_scheduler_step`` hook (a LightningModule; ``None``: no schedulers to wrap)."""
        self.detach()
        self.applied = float(saved_scale)
        groups = [g for opt in optimizers for g in _compat.unwrap_optimizer(opt).param_groups]
        self._groups = [_Group(g, g["lr"] / self.applied) for g in groups]
        if module is not None and hasattr(module, "lr_scheduler_step"):
            self._patches.append(
                _compat.Patch(
                    module,
                    "lr_scheduler_step",
                    self._unscaled_step(module.lr_scheduler_step),
                    name="elastic LR scale around lr_scheduler_step",
                ).install()
            )

    def _unscaled_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        # A partial of a method, not a closure: the module carries it while fit runs, and a module (or anything that
        # holds one, such as a library's hyperparameters) must stay picklable, as under DDPStrategy.
        return functools.partial(self._lr_scheduler_step, step)

    def _lr_scheduler_step(self, step: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = getattr(scheduler, "optimizer", None)
        groups = [s for s in self._groups if any(s.group is g for g in getattr(optimizer, "param_groups", []))]
        for g in groups:
            g.group["lr"] = g.read_unscaled()
        try:
            return step(scheduler, *args, **kwargs)
        finally:
            for g in groups:
                g.unscaled = g.group["lr"]
                g.write(self.applied)
            if groups:
                _compat.set_scheduler_last_lr(scheduler, [g.written for g in groups])

    def factor(self, global_step: int) -> float:
        """The factor on the run's own rates for the optimizer step taken at ``global_step``: the elastic resumes'
        times the live replica groups'."""
        return self.scale.at(global_step) * self.replica.at(global_step)

    def unscaled(self) -> list[float]:
        """The run's own rate of every param group, in the order :meth:`attach` took them."""
        return [g.read_unscaled() for g in self._groups]

    def rebind(self, optimizers: Iterable[torch.optim.Optimizer], *, unscaled: list[float], applied: float) -> None:
        """The optimizers' state was replaced in place (a replica group's heal): their rates are another process's,
        which carried the factor ``applied`` over the run's own rates ``unscaled`` (that process's :meth:`unscaled`,
        in the same order). Taken as they are, bitwise (no division); the ``lr_scheduler_step`` wrapper stays."""
        groups = [g for opt in optimizers for g in _compat.unwrap_optimizer(opt).param_groups]
        if len(groups) != len(unscaled):
            raise ValueError(
                f"ScaledLearningRates.rebind: {len(groups)} param groups here, {len(unscaled)} rates received"
            )
        self._groups = [_Group(g, float(u)) for g, u in zip(groups, unscaled, strict=True)]
        self.applied = float(applied)

    def apply(self, global_step: int) -> float:
        """Set every rate for the optimizer step taken at ``global_step``; returns the factor."""
        scale = self.factor(global_step)
        for g in self._groups:
            if scale != self.applied or g.group["lr"] != g.written:
                g.read_unscaled()
                g.write(scale)
        self.applied = scale
        return scale

    def detach(self) -> None:
        """Undo the ``lr_scheduler_step`` wrapper and forget the optimizers; the rates stay as they are."""
        for patch in reversed(self._patches):
            patch.undo()
        self._patches = []
        self._groups = []
