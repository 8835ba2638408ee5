"""The learning-rate scale that elastic resumes introduce, carried across any number of resumes.

A resume at another data-parallel size with ``ElasticPolicy(batch="keep_local")`` changes the global batch, and the
policy scales every learning rate by ``lr_scale`` (ramped in over ``lr_warmup_steps``). :class:`LRScale` holds that
factor: the scale carried over from earlier resumes times the ramp of the latest decision. The strategy multiplies
the rates by :meth:`LRScale.at` around each optimizer step, so LR schedulers keep computing the unscaled schedule, and
saves :meth:`LRScale.at` of the save's step as ``lr_scale`` in the checkpoint metadata.
"""

from __future__ import annotations

from lightning_ft.elastic.rescale import ResumeDecision


class LRScale:
    """Factor on every learning rate, relative to the run's own rates; 1.0 until an elastic resume changes it.

    Example::

        scale = LRScale()
        scale.resume(carried=1.0, decision=decision, step=1200)  # after plan_resume(...)
        scale.at(1250)  # ramping from 1.0 towards decision.lr_scale
    """

    def __init__(self) -> None:
        self.carried = 1.0
        """The scale saved in the checkpoint that was resumed (earlier resumes' effect)."""
        self._decision: ResumeDecision | None = None
        self._resume_step = 0

    def resume(self, *, carried: float, decision: ResumeDecision, step: int) -> None:
        """Set the state after resuming at global ``step`` from a checkpoint saved with scale ``carried``."""
        self.carried = float(carried)
        self._decision = decision if decision.lr_scale != 1.0 else None
        self._resume_step = int(step)

    def at(self, global_step: int) -> float:
        """The scale at ``global_step`` (optimizer steps)."""
        if self._decision is None:
            return self.carried
        return self.carried * self._decision.lr_scale_at(global_step - self._resume_step)
