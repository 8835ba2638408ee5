"""What replica groups must agree on before they train together: the run's configuration, read on every group, sent
as a fixed-size row and compared field by field (lightning_ft/replica/one_model.py decides which group is refused).

:func:`run_configuration` reads it from a running fit; :func:`encode_configuration` and
:func:`decode_configuration` carry it through one all-gather (its JSON, 6 bytes a float64 slot, a part too large
replaced by its digest); :func:`first_difference` names the first field that differs, with both values, as a path
the user can find in their code (``optimizers[0].param_groups[0].lr``).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_ft import _compat

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "CONFIGURATION_FIELDS",
    "Difference",
    "decode_configuration",
    "digest",
    "encode_configuration",
    "first_difference",
    "optimizer_settings",
    "run_configuration",
]

CONFIGURATION_FIELDS = (
    "processes per group",
    "per-device batch",
    "accumulate_grad_batches",
    "precision",
    "model",
    "optimizers",
    "lr_schedulers",
    "gradient clipping",
    "elastic",
    "validation",
    "run length",
)
"""What the groups must agree on, in the order a difference is named."""

_CONFIGURATION_BYTES = 3072  # the configuration's JSON in one exchange (larger parts are replaced by their digest)
_CHUNK = 6  # bytes per float64 slot: below 2**53, exact
_DIGEST_BYTES = 6


def digest(data: bytes) -> int:
    """A digest of ``data`` below 2**48 (exact in a float64)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest(), "little")


def _plain(value: Any) -> Any:
    """``value`` as JSON (tensors of one element as numbers, other objects by their type's name)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.Tensor):
        return _plain(value.item()) if value.numel() == 1 else f"tensor{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    return type(value).__qualname__


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_settings(trainer: pl.Trainer) -> dict[str, Any]:
    """The optimizers and LR schedulers as configured (read at set-up, before a checkpoint's state replaces the
    hyperparameters): each optimizer's class and, per parameter group, its hyperparameters and number of tensors."""
    optimizers = []
    for optimizer in trainer.optimizers:
        optimizer = _compat.unwrap_optimizer(optimizer)
        groups = [
            {**{k: _plain(v) for k, v in group.items() if k != "params"}, "params": len(group["params"])}
            for group in optimizer.param_groups
        ]
        optimizers.append({"class": _qualname(optimizer), "param_groups": groups})
    schedulers = [
        {
            "class": _qualname(config.scheduler),
            "interval": config.interval,
            "frequency": config.frequency,
            "monitor": config.monitor,
        }
        for config in trainer.lr_scheduler_configs
    ]
    return {"optimizers": optimizers, "lr_schedulers": schedulers}


def run_configuration(
    trainer: pl.Trainer, *, group_size: int, accumulate: int, optimizers: dict[str, Any], elastic: Any
) -> dict[str, Any]:
    """What the replica groups must agree on (:data:`CONFIGURATION_FIELDS`), as JSON values. ``accumulate`` and
    ``optimizers`` (:func:`optimizer_settings`) are read at set-up; the rest when the training loader exists."""
    module = trainer.lightning_module
    shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    return {
        "processes per group": int(group_size),
        "per-device batch": _device_batch(getattr(trainer, "train_dataloader", None)),
        "accumulate_grad_batches": int(accumulate),
        "precision": str(trainer.precision),
        "model": {
            "class": _qualname(module),
            "tensors": len(shapes),
            "elements": sum(math.prod(shape) for _, shape, _ in shapes),
            "structure": f"{digest(repr(shapes).encode()):012x}",
        },
        "optimizers": optimizers["optimizers"],
        "lr_schedulers": optimizers["lr_schedulers"],
        "gradient clipping": {
            "gradient_clip_val": _plain(trainer.gradient_clip_val),
            "gradient_clip_algorithm": _plain(trainer.gradient_clip_algorithm),
        },
        "elastic": _plain(elastic),
        "validation": {
            "val_check_interval": _plain(trainer.val_check_interval),
            "check_val_every_n_epoch": _plain(trainer.check_val_every_n_epoch),
            "limit_val_batches": _plain(trainer.limit_val_batches),
        },
        "run length": {
            "max_steps": trainer.max_steps,
            "max_epochs": trainer.max_epochs,
            "min_steps": trainer.min_steps,
            "min_epochs": trainer.min_epochs,
        },
    }


def _device_batch(loader: Any) -> int | None:
    """The batch size of the first training DataLoader (``None``: none found)."""
    if isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    elif isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    if loader is None:
        return None
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return int(size) if size is not None else None


def encode_configuration(configuration: dict[str, Any]) -> list[float]:
    """``configuration`` as a fixed number of float64 slots (its JSON, 6 bytes a slot); a part too large to fit is
    replaced by its digest (``{"digest": ...}``), the largest first."""
    fitted = dict(configuration)
    while True:
        data = json.dumps(fitted, sort_keys=True, separators=(",", ":")).encode()
        if len(data) <= _CONFIGURATION_BYTES:
            break
        sizes = {k: len(json.dumps(v)) for k, v in fitted.items() if not (isinstance(v, dict) and "digest" in v)}
        largest = max(sizes, key=sizes.__getitem__)
        fitted[largest] = {"digest": f"{digest(json.dumps(fitted[largest], sort_keys=True).encode()):012x}"}
    padded = data + bytes(-len(data) % _CHUNK)
    slots = [float(int.from_bytes(padded[i : i + _CHUNK], "little")) for i in range(0, len(padded), _CHUNK)]
    return [float(len(data))] + slots + [0.0] * (_configuration_slots() - 1 - len(slots))


def _configuration_slots() -> int:
    return 1 + math.ceil(_CONFIGURATION_BYTES / _CHUNK)


def decode_configuration(slots: list[float]) -> dict[str, Any] | None:
    """The configuration :func:`encode_configuration` wrote (``None``: not a configuration)."""
    try:
        length = int(slots[0])
        data = b"".join(int(v).to_bytes(_CHUNK, "little") for v in slots[1:])[:length]
        value = json.loads(data.decode())
    except (ValueError, OverflowError, UnicodeDecodeError, IndexError):
        return None
    return value if isinstance(value, dict) else None


class Difference:
    """The first field in which one group's configuration differs from the reference's."""

    def __init__(self, field: str, value: Any, expected: Any) -> None:
        self.field = field
        self.value = value
        self.expected = expected

    def describe(self, *, here: str, there: str) -> str:
        return f"{self.field}: {_show(self.value)} {here}, {_show(self.expected)} {there}"

    def __repr__(self) -> str:
        return f"Difference({self.field!r}, {self.value!r}, {self.expected!r})"


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else repr(value)


def first_difference(value: dict[str, Any], expected: dict[str, Any]) -> Difference | None:
    """The first field (in :data:`CONFIGURATION_FIELDS` order, then depth first) where ``value`` differs from
    ``expected``, named as a path (``optimizers[0].param_groups[0].lr``); ``None`` when they are equal."""
    names = [f for f in CONFIGURATION_FIELDS if f in value or f in expected]
    names += sorted((set(value) | set(expected)) - set(names))
    for name in names:
        found = _walk(name, value.get(name), expected.get(name))
        if found is not None:
            return found
    return None


def _walk(path: str, value: Any, expected: Any) -> Difference | None:
    if isinstance(value, dict) and isinstance(expected, dict) and "digest" not in value and "digest" not in expected:
        for key in list(expected) + [k for k in value if k not in expected]:
            found = _walk(f"{path}.{key}", value.get(key), expected.get(key))
            if found is not None:
                return found
        return None
    if isinstance(value, list) and isinstance(expected, list) and len(value) == len(expected):
        for i, (a, b) in enumerate(zip(value, expected, strict=True)):
            found = _walk(f"{path}[{i}]", a, b)
            if found is not None:
                return found
        return None
    return None if value == expected else Difference(path, value, expected)
