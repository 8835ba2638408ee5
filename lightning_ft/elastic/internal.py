"""The seam between the packages: what the strategy (and, where docs/architecture.md allows it, fault handling and the
CLI) use of this package beyond its public names. It is not API: users are taught the public names of
:mod:`lightning_ft.elastic` (docs/); these may change in any release. The architecture test allows this module to be
imported only by the packages that may import ``elastic`` (tests/test_architecture.py, ``ALLOWED``) and by the tests.

The strategy decides a resume (:func:`plan_resume_from_metadata`), applies its learning-rate scale
(:class:`ScaledLearningRates`), keeps the data position and swaps in the resumable sampler. The replica mode deals the
rest of an epoch anew over the live groups at every membership change and discarded step (:func:`reshard_sampler`,
:func:`committed_after`, :func:`group_remainder`) and applies the ``ElasticPolicy`` to the live groups
(:func:`check_replica_policy`, :func:`plan_replica_batch`).
"""

from lightning_ft.elastic.data_rng import DATA_RANDOMNESS
from lightning_ft.elastic.dataloader import (
    TrainingDataPosition,
    align_batch_progress,
    find_resumable_sampler,
    swap_in_resumable_sampler,
)
from lightning_ft.elastic.lr_scale import LRScale
from lightning_ft.elastic.rank_rng import new_rank_rng_states, resumed_rng_states
from lightning_ft.elastic.replica_data import (
    GroupRemainder,
    ReplicaMembership,
    committed_after,
    deal_changes,
    group_remainder,
    reshard_sampler,
)
from lightning_ft.elastic.replica_policy import (
    ReplicaBatchPlan,
    check_replica_policy,
    plan_replica_batch,
    replica_policy_message,
)
from lightning_ft.elastic.rescale import (
    ResumeDecision,
    check_accumulation_scheduler,
    plan_resume,
    plan_resume_from_metadata,
)
from lightning_ft.elastic.resume_timing import previous_world, resume_timing
from lightning_ft.elastic.scaled_learning_rates import ScaledLearningRates

__all__ = [
    "DATA_RANDOMNESS",
    "GroupRemainder",
    "LRScale",
    "ReplicaBatchPlan",
    "ReplicaMembership",
    "ResumeDecision",
    "ScaledLearningRates",
    "TrainingDataPosition",
    "align_batch_progress",
    "check_accumulation_scheduler",
    "check_replica_policy",
    "committed_after",
    "find_resumable_sampler",
    "deal_changes",
    "group_remainder",
    "new_rank_rng_states",
    "plan_replica_batch",
    "plan_resume",
    "plan_resume_from_metadata",
    "previous_world",
    "replica_policy_message",
    "reshard_sampler",
    "resume_timing",
    "resumed_rng_states",
    "swap_in_resumable_sampler",
]
