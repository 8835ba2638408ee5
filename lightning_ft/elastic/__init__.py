"""Elastic training: batch and learning-rate rescaling on resume, and a world-size-independent resumable sampler.

The public names are those docs/elastic.md teaches; the strategy's glue (the resume decision, the learning-rate
scale, the data position, the sampler swap) is in :mod:`lightning_ft.elastic.internal` (not API).
"""

from lightning_ft.elastic.compatible_sizes import compatible_data_parallel_sizes, compatible_world_sizes
from lightning_ft.elastic.elastic_policy import ElasticPolicy
from lightning_ft.elastic.rank_rng import new_rank_seed
from lightning_ft.elastic.resumable_sampler import ResumableSampler

__all__ = [
    "ElasticPolicy",
    "ResumableSampler",
    "compatible_data_parallel_sizes",
    "compatible_world_sizes",
    "new_rank_seed",
]
