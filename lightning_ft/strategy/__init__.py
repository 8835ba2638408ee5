"""``ElasticFT3D``, the Lightning strategy, and the pieces it composes (one module each).

``from lightning_ft.strategy import ElasticFT3D`` is the public import; the modules of this package are the strategy's
own parts: :mod:`~lightning_ft.strategy.elastic_ft3d` (the Lightning hooks), :mod:`~lightning_ft.strategy.process_group`,
:mod:`~lightning_ft.strategy.torchrun_world`, :mod:`~lightning_ft.strategy.parallel_modes`,
:mod:`~lightning_ft.strategy.checkpoint_io`, :mod:`~lightning_ft.strategy.auto_resume`,
:mod:`~lightning_ft.strategy.tracker`, :mod:`~lightning_ft.strategy.elastic_resume`,
:mod:`~lightning_ft.strategy.run` (the collaborators of one run), :mod:`~lightning_ft.strategy.teardown` and
:mod:`~lightning_ft.strategy.registry`.

``ElasticFT3D`` is imported on first use, so that ``import lightning_ft`` can import
:mod:`~lightning_ft.strategy.registry` (which registers ``Trainer(strategy="elastic_ft3d")``) without Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_ft.strategy.elastic_ft3d import ElasticFT3D

__all__ = ["ElasticFT3D"]


def __getattr__(name: str) -> Any:
    if name != "ElasticFT3D":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lightning_ft.strategy.elastic_ft3d import ElasticFT3D

    globals()[name] = ElasticFT3D
    return ElasticFT3D
