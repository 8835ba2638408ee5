"""Elastic training: batch and learning-rate rescaling on resume, and a world-size-independent resumable sampler."""

from lightning_ft.elastic.dataloader import align_batch_progress, find_resumable_sampler, swap_in_resumable_sampler
from lightning_ft.elastic.elastic_policy import ElasticPolicy
from lightning_ft.elastic.rescale import ResumeDecision, check_accumulation_scheduler, plan_resume
from lightning_ft.elastic.resumable_sampler import ResumableSampler

__all__ = [
    "ElasticPolicy",
    "ResumableSampler",
    "ResumeDecision",
    "align_batch_progress",
    "check_accumulation_scheduler",
    "find_resumable_sampler",
    "plan_resume",
    "swap_in_resumable_sampler",
]
