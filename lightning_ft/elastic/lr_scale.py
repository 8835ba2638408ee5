"""The learning-rate scale that elastic resumes introduce, carried across any number of resumes.

A resume that changes the global batch under ``ElasticPolicy(batch="keep_local")`` scales every learning rate by the
decision's ``lr_scale``, ramped in over ``lr_warmup_steps``. :class:`LRScale` is that factor as a function of the
global step: a linear ramp from ``start_scale`` at ``start_step`` to ``target`` ``warmup_steps`` later, constant
outside it. Its whole state (not only today's value) is saved in every checkpoint's metadata, so a ramp interrupted by
another resume continues where it was, and a further resize ramps from the value reached towards the product of the
targets.
"""

from __future__ import annotations

from typing import Any

from lightning_ft.elastic.rescale import ResumeDecision

_STATE_KEYS = ("start_scale", "target", "start_step", "warmup_steps")


class LRScale:
    """Factor on every learning rate, relative to the run's own rates; 1.0 until an elastic resume changes it.

    Example::

        scale = LRScale()
        scale.resume(decision, step=1200)  # decision from plan_resume(...): lr_scale 0.5 over 100 steps
        scale.at(1250)  # 0.75
        checkpoint_metadata["lr_scale_state"] = scale.state_dict()
    """

    def __init__(self) -> None:
        self.start_scale = 1.0
        """The factor at ``start_step``."""
        self.target = 1.0
        """The factor from ``start_step + warmup_steps`` on: the product of every resume's ``lr_scale``."""
        self.start_step = 0
        """Global step where the current ramp starts."""
        self.warmup_steps = 0
        """Optimizer steps the current ramp takes; 0: the target holds from ``start_step``."""

    def at(self, global_step: int) -> float:
        """The factor for the optimizer step taken when ``trainer.global_step == global_step``."""
        done = global_step - self.start_step
        if self.warmup_steps <= 0 or done >= self.warmup_steps:
            return self.target
        return self.start_scale + (self.target - self.start_scale) * max(done, 0) / self.warmup_steps

    def resume(self, decision: ResumeDecision, *, step: int) -> None:
        """Compose a resume at global ``step`` with this state (restored from the checkpoint first).

        A decision that leaves the learning rate alone (``lr_scale == 1.0``) changes nothing: a ramp in progress
        continues. Otherwise a new ramp starts at the factor reached at ``step`` and ends at the current target times
        ``decision.lr_scale``, ``decision.lr_warmup_steps`` steps later.
        """
        if decision.lr_scale == 1.0:
            return
        reached = self.at(step)
        self.start_scale, self.target = reached, self.target * decision.lr_scale
        self.start_step, self.warmup_steps = int(step), int(decision.lr_warmup_steps)

    def ramp_to(self, target: float, *, step: int, warmup_steps: int) -> None:
        """Ramp from the factor reached at global ``step`` to ``target`` (an absolute factor, not a product) over
        ``warmup_steps`` optimizer steps (0: at once). A target already in force changes nothing. The replica mode's
        factor of the live groups (:mod:`lightning_ft.elastic.replica_policy`) follows it."""
        target = float(target)
        if target == self.target:
            return
        reached = self.at(step)
        self.start_scale, self.target = reached, target
        self.start_step, self.warmup_steps = int(step), int(warmup_steps)

    def state_dict(self) -> dict[str, Any]:
        """Plain state: ``start_scale``, ``target``, ``start_step``, ``warmup_steps``."""
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: a key is missing.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"LRScale.load_state_dict: the state lacks {missing}; got {state!r}")
        self.start_scale, self.target = float(state["start_scale"]), float(state["target"])
        self.start_step, self.warmup_steps = int(state["start_step"]), int(state["warmup_steps"])

    def load_constant(self, scale: float) -> None:
        """Hold ``scale`` from now on (a checkpoint of lightning-ft 0.1.0 saved only today's factor)."""
        self.start_scale = self.target = float(scale)
        self.start_step, self.warmup_steps = 0, 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in _STATE_KEYS)})"
