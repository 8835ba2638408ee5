"""The commit gate: a step the replica groups discarded is not applied and not counted, in one place.

torchft decides at the end of every step, after the gradients were averaged across groups, whether the step may be
applied (``Manager.should_commit()``: False on every group when any of them failed during the step, or when fewer
than ``min_replicas`` took part). Lightning's loop does not know that a step can be discarded, so this module makes a
discarded step invisible to it, at the one place where the step is applied (the strategy's ``optimizer_step``):

- while Lightning's precision plugin steps, the optimizer's ``step`` runs the closure (forward, backward with the
  gradient averaging, ``on_before_optimizer_step``, gradient clipping) and then asks the gate; only a committed step
  reaches the real ``optimizer.step()``;
- a discarded step takes back the counts Lightning makes for it (``trainer.global_step`` and the logging step,
  :func:`~lightning_ft._compat.uncount_optimizer_step`), so that ``max_steps``, ``every_n_train_steps``,
  ``log_every_n_steps`` and validation by step count committed steps only;
- the LR schedulers stepped per step are not stepped for it: the LightningModule's ``lr_scheduler_step`` hook is
  wrapped for the fit (undone at teardown) and skips the schedulers with ``interval="step"`` until the next step.

Epoch-interval schedulers, the batch counters (``batch_idx``: the batch was read) and the epoch are unchanged: the
discarded step's batch is consumed and its gradients dropped, as in torchft.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_ft import _compat

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

__all__ = ["StepGate"]


class StepGate:
    """Applies or discards each optimizer step of a fit on the vote of ``should_commit`` (see the module docstring).

    Args:
        should_commit: the vote, called once per optimizer step on every rank of the group (collective in the group).
    """

    def __init__(self, should_commit: Callable[[], bool]) -> None:
        self._should_commit = should_commit
        self._discarding = False
        self._patch: _compat.Patch | None = None
        self._step_schedulers: list[Any] = []
        self.discarded = 0
        """Steps discarded in this fit."""

    def install(self, trainer: pl.Trainer) -> None:
        """Wrap the LightningModule's ``lr_scheduler_step`` for this fit (after the optimizers are set up)."""
        module = trainer.lightning_module
        self._step_schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]
        original = module.lr_scheduler_step
        progress = trainer.fit_loop.epoch_loop.scheduler_progress

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if self._discarding and any(scheduler is s for s in self._step_schedulers):
                # Lightning counts ready before this hook and completed after it: take both back.
                progress.total.ready -= 1
                progress.current.ready -= 1
                progress.total.completed -= 1
                progress.current.completed -= 1
                return
            original(scheduler, metric)

        self._patch = _compat.Patch(module, "lr_scheduler_step", lr_scheduler_step, name="replica step gate").install()

    def uninstall(self) -> None:
        if self._patch is not None:
            self._patch.undo()
            self._patch = None

    def begin_step(self) -> None:
        """A new optimizer step starts (the schedulers of the previous one have run)."""
        self._discarding = False

    def optimizer_step(self, trainer: pl.Trainer, optimizer: Optimizer, run: Callable[[Any], Any]) -> Any:
        """Run ``run(optimizer)`` (Lightning's precision plugin step) with the optimizer's ``step`` behind the gate.

        For the duration of the call, ``optimizer.step(closure)`` runs the closure (forward, backward with the
        gradient averaging, ``on_before_optimizer_step``, gradient clipping), then asks for the vote and steps the
        optimizer only on a commit. The optimizer object itself is the user's (hooks that receive it see its own
        class); the instance attribute is put back when the step returns or raises."""
        original = optimizer.step

        def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            loss = closure() if closure is not None else None
            if self._decide(trainer):
                original(**kwargs)
            return loss

        patch = _compat.Patch(optimizer, "step", step, name="replica step gate").install()
        try:
            return run(optimizer)
        finally:
            patch.undo()

    def _decide(self, trainer: pl.Trainer) -> bool:
        committed = bool(self._should_commit())
        if not committed:
            self.discarded += 1
            self._discarding = True
            _compat.uncount_optimizer_step(trainer)
        return committed
