"""Elastic training: batch and learning-rate rescaling on resume, and a world-size-independent resumable sampler."""

from lightning_ft.elastic.dataloader import (
    TrainingDataPosition,
    align_batch_progress,
    find_resumable_sampler,
    swap_in_resumable_sampler,
)
from lightning_ft.elastic.elastic_policy import ElasticPolicy
from lightning_ft.elastic.lr_scale import LRScale
from lightning_ft.elastic.rescale import (
    ResumeDecision,
    check_accumulation_scheduler,
    plan_resume,
    plan_resume_from_metadata,
)
from lightning_ft.elastic.resumable_sampler import ResumableSampler

__all__ = [
    "ElasticPolicy",
    "LRScale",
    "ResumableSampler",
    "ResumeDecision",
    "TrainingDataPosition",
    "align_batch_progress",
    "check_accumulation_scheduler",
    "find_resumable_sampler",
    "plan_resume",
    "plan_resume_from_metadata",
    "swap_in_resumable_sampler",
]
