"""Elastic training: batch and learning-rate rescaling on resume, and a world-size-independent resumable sampler."""

from lightning_ft.elastic.compatible_sizes import compatible_data_parallel_sizes, compatible_world_sizes
from lightning_ft.elastic.dataloader import (
    TrainingDataPosition,
    align_batch_progress,
    find_resumable_sampler,
    swap_in_resumable_sampler,
)
from lightning_ft.elastic.elastic_policy import ElasticPolicy
from lightning_ft.elastic.lr_scale import LRScale
from lightning_ft.elastic.rank_rng import new_rank_rng_states, new_rank_seed, resumed_rng_states
from lightning_ft.elastic.rescale import (
    ResumeDecision,
    check_accumulation_scheduler,
    plan_resume,
    plan_resume_from_metadata,
)
from lightning_ft.elastic.resumable_sampler import ResumableSampler
from lightning_ft.elastic.scaled_learning_rates import ScaledLearningRates

__all__ = [
    "ElasticPolicy",
    "LRScale",
    "ResumableSampler",
    "ResumeDecision",
    "ScaledLearningRates",
    "TrainingDataPosition",
    "align_batch_progress",
    "check_accumulation_scheduler",
    "compatible_data_parallel_sizes",
    "compatible_world_sizes",
    "find_resumable_sampler",
    "new_rank_rng_states",
    "new_rank_seed",
    "plan_resume",
    "plan_resume_from_metadata",
    "resumed_rng_states",
    "swap_in_resumable_sampler",
]
