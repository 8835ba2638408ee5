"""``ElasticFT3D``, the Lightning strategy, and the pieces it composes (one module each).

``from lightning_ft.strategy import ElasticFT3D`` is the public import; the modules of this package are the strategy's
own parts: :mod:`~lightning_ft.strategy.elastic_ft3d` (the Lightning hooks), :mod:`~lightning_ft.strategy.process_group`,
:mod:`~lightning_ft.strategy.parallel_modes`, :mod:`~lightning_ft.strategy.checkpoint_io`,
:mod:`~lightning_ft.strategy.auto_resume` and :mod:`~lightning_ft.strategy.tracker`.
"""

from lightning_ft.strategy.elastic_ft3d import ElasticFT3D

__all__ = ["ElasticFT3D"]
