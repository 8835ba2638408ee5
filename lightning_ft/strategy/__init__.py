"""``ElasticFT3D``, the Lightning strategy, and the pieces it composes (one module each).

``from lightning_ft.strategy import ElasticFT3D`` is the public import; the modules of this package are the strategy's
own parts: :mod:`~lightning_ft.strategy.elastic_ft3d` (the Lightning hooks), :mod:`~lightning_ft.strategy.process_group`,
:mod:`~lightning_ft.strategy.torchrun_world`, :mod:`~lightning_ft.strategy.parallel_modes`,
:mod:`~lightning_ft.strategy.checkpoint_io`, :mod:`~lightning_ft.strategy.auto_resume`,
:mod:`~lightning_ft.strategy.tracker`, :mod:`~lightning_ft.strategy.elastic_resume`,
:mod:`~lightning_ft.strategy.run` (the collaborators of one run), :mod:`~lightning_ft.strategy.teardown` and
:mod:`~lightning_ft.strategy.registry`.

Importing this package registers the strategy's names with Lightning's ``StrategyRegistry``
(``Trainer(strategy="elastic_ft3d")``; see :mod:`~lightning_ft.strategy.registry`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ft.strategy.elastic_ft3d import ElasticFT3D

ElasticFT3D.register_strategies(StrategyRegistry)

__all__ = ["ElasticFT3D"]
