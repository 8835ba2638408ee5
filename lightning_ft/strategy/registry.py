"""The names under which ``ElasticFT3D`` is known to Lightning's strategy registry.

Lightning resolves a strategy given as a string through its ``StrategyRegistry``: ``Trainer(strategy="elastic_ft3d")``
and LightningCLI's ``--trainer.strategy=elastic_ft3d``. LightningCLI also hands ``--trainer.strategy=
lightning_ft.ElasticFT3D`` to the Trainer as a plain string (the Trainer's ``strategy`` argument accepts a string
before a ``Strategy``), and Lightning lowercases strategy strings, so the class paths are registered as names too.
``lightning_ft.strategy`` registers them when it is imported (``from lightning_ft import ElasticFT3D`` imports it).
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


def register_strategy_names(cls: type, registry: Any) -> None:
    """Register every name of :data:`STRATEGY_NAMES` for ``cls`` in Lightning's strategy ``registry``.

    Idempotent (the same class imported again replaces its entries). A name that another class was registered under
    first is left to it.
    """
    for name, options in STRATEGY_NAMES.items():
        # `registry.get` would build the strategy; the entry itself says what it builds.
        if name in registry and getattr(registry[name]["strategy"], "__qualname__", None) != cls.__qualname__:
            continue
        described = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "default options"
        registry.register(
            name,
            cls,
            description=f"lightning-ft {cls.__name__} ({described}): fault-tolerant, elastic data x tensor x pipeline"
            " parallel training; other options through class_path and init_args",
            override=True,
            **options,
        )
