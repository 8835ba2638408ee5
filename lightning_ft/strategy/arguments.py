"""The checks ``ElasticFT3D(...)`` runs on its arguments at construction, before any process or file exists."""

from __future__ import annotations

from typing import Any

from lightning_ft.checkpoint.storage import storage_named
from lightning_ft.elastic import ElasticPolicy
from lightning_ft.elastic.data_rng import DATA_RANDOMNESS
from lightning_ft.fault import FaultPolicy
from lightning_ft.parallel.schedules import PIPELINE_SCHEDULES
from lightning_ft.parallel.validation import check_positive_int

__all__ = ["check_strategy_arguments"]


def check_strategy_arguments(
    *,
    data_parallel_size: Any,
    tensor_parallel_size: Any,
    pipeline_parallel_size: Any,
    pipeline_schedule: str,
    num_microbatches: Any,
    elastic: Any,
    fault: Any,
    checkpoint_format: str,
    data_randomness: Any = "ddp",
) -> None:
    """Raise ``TypeError`` or ``ValueError`` naming the option, its value and the rule for the first bad argument."""
    check_positive_int("ElasticFT3D", "data_parallel_size", data_parallel_size, allow_auto=True)
    check_positive_int("ElasticFT3D", "tensor_parallel_size", tensor_parallel_size, allow_auto=True)
    check_positive_int("ElasticFT3D", "pipeline_parallel_size", pipeline_parallel_size)
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"ElasticFT3D(pipeline_schedule={pipeline_schedule!r}): must be one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    if num_microbatches is not None:
        check_positive_int("ElasticFT3D", "num_microbatches", num_microbatches)
    if elastic is not None and not isinstance(elastic, ElasticPolicy):
        raise TypeError(f"ElasticFT3D(elastic={elastic!r}): must be an ElasticPolicy or None")
    if fault is not None and not isinstance(fault, FaultPolicy):
        raise TypeError(f"ElasticFT3D(fault={fault!r}): must be a FaultPolicy or None")
    storage_named(checkpoint_format, owner="ElasticFT3D")
    if data_randomness not in DATA_RANDOMNESS:
        raise ValueError(
            f"ElasticFT3D(data_randomness={data_randomness!r}): must be one of {', '.join(map(repr, DATA_RANDOMNESS))}"
            " ('ddp' draws what DDPStrategy draws; 'per_sample' seeds every training sample from its place)"
        )
