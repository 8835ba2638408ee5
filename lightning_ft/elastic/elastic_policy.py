"""What happens to the batch size and the learning rate when a run resumes at another world size.

:class:`ElasticPolicy` is the ``elastic=`` argument of :class:`lightning_ft.ElasticFT3D`. It only states the user's
choice; :func:`lightning_ft.elastic.plan_resume` turns it, the metadata of the checkpoint and the new world into the
gradient accumulation and learning-rate scale the strategy applies. ``elastic=None`` refuses such a resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

_BATCH_CHOICES = ("keep_global", "keep_local")
_LR_SCALING_CHOICES = ("linear", "sqrt", "none")


@dataclass(kw_only=True, frozen=True)
class ElasticPolicy:
    """How a run adapts when it resumes on a different data-parallel size.

    Example::

        from lightning_ft import ElasticFT3D, ElasticPolicy

        strategy = ElasticFT3D(elastic=ElasticPolicy(batch="keep_global", lr_scaling="linear"))

    Or in a LightningCLI config::

        trainer:
          strategy:
            class_path: lightning_ft.ElasticFT3D
            init_args:
              elastic:
                class_path: lightning_ft.ElasticPolicy
                init_args: {batch: keep_local, lr_scaling: sqrt, lr_warmup_steps: 100}
    """

    batch: Literal["keep_global", "keep_local"] = "keep_global"
    """``"keep_global"``: keep the global batch (per-device batch x data-parallel size x gradient accumulation) by
    changing gradient accumulation; the new data-parallel size must divide it. ``"keep_local"``: keep the per-device
    batch and the accumulation, so the global batch changes with the data-parallel size."""

    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """How the learning rate follows a change of the global batch: ``"linear"`` multiplies it by new / old global
    batch, ``"sqrt"`` by the square root of that, ``"none"`` leaves it. With ``"keep_global"`` the ratio is 1."""

    lr_warmup_steps: int = 0
    """Optimizer steps over which a learning-rate change is ramped in linearly after such a resume; 0 applies it at
    once."""

    def __post_init__(self) -> None:
        if self.batch not in _BATCH_CHOICES:
            raise ValueError(
                f"ElasticPolicy(batch={self.batch!r}): must be one of {', '.join(map(repr, _BATCH_CHOICES))}"
            )
        if self.lr_scaling not in _LR_SCALING_CHOICES:
            raise ValueError(
                f"ElasticPolicy(lr_scaling={self.lr_scaling!r}): must be one of"
                f" {', '.join(map(repr, _LR_SCALING_CHOICES))}"
            )
        if isinstance(self.lr_warmup_steps, bool) or not isinstance(self.lr_warmup_steps, int):
            raise TypeError(f"ElasticPolicy(lr_warmup_steps={self.lr_warmup_steps!r}): must be an int")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"ElasticPolicy(lr_warmup_steps={self.lr_warmup_steps}): must be >= 0 (0 means no ramp)")

    def lr_factor(self, ratio: float) -> float:
        """The factor on the learning rates for a global batch ``ratio`` times the reference's: 1.0 under
        ``keep_global`` (the global batch is kept), else ``lr_scaling``'s rule of ``ratio``."""
        if self.batch == "keep_global":
            return 1.0
        return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[self.lr_scaling]
