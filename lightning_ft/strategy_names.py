"""The names under which ``ElasticFT3D`` is known to Lightning's strategy registry.

Lightning resolves a strategy given as a string through its ``StrategyRegistry``: ``Trainer(strategy="elastic_ft3d")``
and LightningCLI's ``--trainer.strategy=elastic_ft3d``. LightningCLI also hands ``--trainer.strategy=
lightning_ft.ElasticFT3D`` to the Trainer as a plain string (the Trainer's ``strategy`` argument accepts a string
before a ``Strategy``), and Lightning lowercases strategy strings, so the class paths are registered as names too.

A name must be registered before the Trainer is built, so importing any of lightning-ft's Lightning-facing packages
registers them: ``lightning_ft.strategy`` and ``lightning_ft.monitors`` (``from lightning_ft import ElasticFT3D`` or
``GoodputMonitor``, or a LightningCLI class path such as ``--trainer.callbacks+=lightning_ft.GoodputMonitor``). The
registry entries build the strategy through a factory, so registering does not import the strategy itself.
"""

from __future__ import annotations

from typing import Any

STRATEGY_NAMES: dict[str, dict[str, Any]] = {
    "elastic_ft3d": {},
    "elastic_ft3d_find_unused_parameters_true": {"find_unused_parameters": True},
    # What LightningCLI passes for `--trainer.strategy=lightning_ft.ElasticFT3D`, once Lightning lowercased it.
    "lightning_ft.elasticft3d": {},
    "lightning_ft.strategy.elasticft3d": {},
}
"""Registry name -> the ``ElasticFT3D`` keyword arguments it stands for (other options keep their defaults)."""


def elastic_ft3d(**options: Any) -> Any:
    """``ElasticFT3D(**options)``: the factory behind every registered name."""
    from lightning_ft.strategy import ElasticFT3D

    return ElasticFT3D(**options)


def register_strategy_names(registry: Any = None) -> None:
    """Register every name of :data:`STRATEGY_NAMES` in ``registry`` (default: Lightning's ``StrategyRegistry``).

    Idempotent. A name that something other than lightning-ft registered first is left as it is.
    """
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry

        registry = StrategyRegistry
    for name, options in STRATEGY_NAMES.items():
        # `registry.get` would build the strategy; the entry itself says what it builds.
        if name in registry and registry[name]["strategy"] is not elastic_ft3d:
            continue
        described = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "default options"
        registry.register(
            name,
            elastic_ft3d,
            description=f"lightning-ft ElasticFT3D ({described}): fault-tolerant, elastic data x tensor x pipeline"
            " parallel training; other options through class_path and init_args",
            override=True,
            **options,
        )
