"""Which world sizes can keep a global batch: the list ``ElasticPolicy(batch="keep_global")`` needs, before a launch.

A run that keeps its global batch across resizes (``batch="keep_global"``) can only resume where a whole gradient
accumulation gives that batch: ``global_batch = per_device_batch x data_parallel_size x accumulate``. DeepSpeed's
elasticity computes the same kind of list (its "valid GPU counts"); :func:`compatible_world_sizes` is the one to use
when choosing ``--nnodes=MIN:MAX`` for torchrun, and the error of a resume that cannot keep the batch quotes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_ft.parallel.internal import check_positive_int, divisors

__all__ = ["compatible_data_parallel_sizes", "compatible_world_sizes"]


def compatible_data_parallel_sizes(*, global_batch: int, per_device_batch: int | Sequence[int]) -> list[int]:
    """Data-parallel sizes at which ``global_batch`` is ``per_device_batch x size x accumulate`` with a whole
    ``accumulate >= 1``, for some per-device batch in ``per_device_batch``; ascending.

    Raises:
        ValueError, TypeError: a size is not a positive int.
    """
    check_positive_int("compatible_world_sizes", "global_batch", global_batch)
    batches = [per_device_batch] if isinstance(per_device_batch, int) else list(per_device_batch)
    if not batches:
        raise ValueError("compatible_world_sizes(per_device_batch=[]): give at least one per-device batch size")
    sizes: set[int] = set()
    for batch in batches:
        check_positive_int("compatible_world_sizes", "per_device_batch", batch)
        if global_batch % batch == 0:
            sizes.update(divisors(global_batch // batch))
    return sorted(sizes)


def compatible_world_sizes(
    *,
    global_batch: int,
    per_device_batch: int | Sequence[int],
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_world_size: int | None = None,
) -> list[int]:
    """World sizes (processes, devices) on which a run keeps ``global_batch`` samples per optimizer step.

    A world size works when its data-parallel size (world size / (tensor x pipeline size)) times some per-device
    batch in ``per_device_batch`` divides ``global_batch``: gradient accumulation makes up the rest.

    Args:
        global_batch: samples per optimizer step to keep.
        per_device_batch: the per-device batch size, or several acceptable ones (like DeepSpeed elasticity's
            ``micro_batch_sizes``).
        tensor_parallel_size: devices per tensor-parallel group; each data-parallel replica needs this many.
        pipeline_parallel_size: pipeline stages; each data-parallel replica needs this many.
        max_world_size: leave out larger world sizes; ``None`` lists them all.

    Raises:
        ValueError, TypeError: a size is not a positive int.

    Example::

        from lightning_ft.elastic import compatible_world_sizes

        compatible_world_sizes(global_batch=48, per_device_batch=4)  # [1, 2, 3, 4, 6, 12]
        compatible_world_sizes(global_batch=48, per_device_batch=4, tensor_parallel_size=2)  # [2, 4, 6, 8, 12, 24]
    """
    check_positive_int("compatible_world_sizes", "tensor_parallel_size", tensor_parallel_size)
    check_positive_int("compatible_world_sizes", "pipeline_parallel_size", pipeline_parallel_size)
    if max_world_size is not None:
        check_positive_int("compatible_world_sizes", "max_world_size", max_world_size)
    per_replica = tensor_parallel_size * pipeline_parallel_size
    worlds = [
        dp * per_replica
        for dp in compatible_data_parallel_sizes(global_batch=global_batch, per_device_batch=per_device_batch)
    ]
    return [w for w in worlds if max_world_size is None or w <= max_world_size]
