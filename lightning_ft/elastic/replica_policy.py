"""The :class:`~lightning_ft.ElasticPolicy` when the number of live replica groups changes (replica-group mode).

In the replica mode (docs/replica-groups.md) groups die and join while the others keep stepping. The reference is the
**full membership**: ``num_groups`` groups (``ReplicaGroups(num_groups=...)`` or ``NUM_REPLICA_GROUPS``) x ranks per
group x per-device batch x the Trainer's ``accumulate_grad_batches``, the global batch ``G``. At ``n`` live groups:

- ``ElasticPolicy(batch="keep_global")``: the gradient accumulation becomes ``G / (per-device batch x ranks per group
  x n)``, so every committed step trains ``G`` samples whatever the membership; the learning rate stays. Checked at
  set-up for every ``n`` from ``min_replicas`` to ``num_groups`` (:func:`check_replica_policy`);
- ``ElasticPolicy(batch="keep_local")``: the per-group batch and the accumulation stay (the global batch follows the
  live groups, as torchft does) and the learning rate is multiplied by the policy's rule of ``n / num_groups``
  (``linear``, ``sqrt`` or ``none``);
- ``elastic=None``: nothing changes (the per-group batch and the learning rate are kept, as ``keep_local`` with
  ``lr_scaling="none"``).

Pure arithmetic: every rank of every group that sees the same quorum computes the same :class:`ReplicaBatchPlan`,
so a healed group ends up with the survivors' accumulation and learning-rate factor without a message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_ft.elastic.elastic_policy import ElasticPolicy

__all__ = [
    "ReplicaBatchPlan",
    "check_replica_policy",
    "needs_num_groups",
    "plan_replica_batch",
    "replica_policy_message",
]


@dataclass(kw_only=True, frozen=True)
class ReplicaBatchPlan:
    """What a group trains with while ``live_groups`` groups are live."""

    live_groups: int
    """Groups in the quorum."""

    num_groups: int
    """Groups of the full membership (the reference)."""

    accumulate_grad_batches: int
    """Batches per optimizer step on every rank."""

    global_batch: int
    """Samples per committed step over every live group: per-device batch x ranks x live groups x accumulation."""

    reference_global_batch: int
    """Samples per committed step at the full membership, with the Trainer's accumulation (``G``)."""

    lr_scale: float
    """Factor on the learning rates relative to the full membership (1.0 under ``keep_global``)."""


def needs_num_groups(policy: ElasticPolicy | None) -> bool:
    """Whether ``policy`` changes anything at a membership change (so the full membership must be known)."""
    return policy is not None and (policy.batch == "keep_global" or policy.lr_scaling != "none")


def plan_replica_batch(
    policy: ElasticPolicy | None,
    *,
    live_groups: int,
    num_groups: int,
    group_size: int,
    device_batch: int,
    accumulate: int,
) -> ReplicaBatchPlan:
    """The accumulation and learning-rate factor at ``live_groups`` live groups (see the module docstring).

    ``accumulate`` is the accumulation at the full membership (the Trainer's, or what an elastic resume of a whole-job
    restart decided for it). Every rank may call it; pure.

    Raises:
        ValueError: a size is not an int >= 1, or ``keep_global`` and ``G`` is not a multiple of per-device batch x
            ranks per group x ``live_groups`` (the message names the rule and the ways out).
    """
    sizes = {
        "live_groups": live_groups,
        "num_groups": num_groups,
        "group_size": group_size,
        "device_batch": device_batch,
        "accumulate": accumulate,
    }
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan_replica_batch({name}={value!r}): must be an int >= 1")
    reference = num_groups * group_size * device_batch * accumulate
    if policy is not None and policy.batch == "keep_global":
        per_batch = device_batch * group_size * live_groups
        if reference % per_batch:
            raise ValueError(_keep_global_error(live_groups, num_groups, group_size, device_batch, accumulate, None))
        acc = reference // per_batch
    else:
        acc = accumulate
    lr_scale = policy.lr_factor(live_groups / num_groups) if policy is not None else 1.0
    return ReplicaBatchPlan(
        live_groups=live_groups,
        num_groups=num_groups,
        accumulate_grad_batches=acc,
        global_batch=device_batch * group_size * live_groups * acc,
        reference_global_batch=reference,
        lr_scale=lr_scale,
    )


def check_replica_policy(
    policy: ElasticPolicy | None,
    *,
    num_groups: int,
    num_groups_known: bool,
    min_replicas: int,
    group_size: int,
    device_batch: int | None,
    accumulate: int,
) -> None:
    """Refuse, at set-up and before any step, a policy the replica mode cannot serve at some membership.

    Every rank calls it with the same values (no communication). ``num_groups_known``: whether the full membership
    was given (``ReplicaGroups(num_groups=...)`` or ``NUM_REPLICA_GROUPS``); ``device_batch``: the training
    DataLoader's batch size (``None``: unknown, e.g. a batch sampler of its own, which ``keep_global`` cannot serve).

    Raises:
        ValueError: the policy needs the full membership and it is unknown; ``keep_global`` with an unknown batch size;
            ``keep_global`` and some ``n`` in ``[min_replicas, num_groups]`` gives a fractional accumulation.
    """
    if not needs_num_groups(policy):
        return
    assert policy is not None
    if not num_groups_known:
        raise ValueError(
            f"ElasticPolicy(batch={policy.batch!r}, lr_scaling={policy.lr_scaling!r}) with replica groups needs the"
            " full membership (the number of groups the job is launched with) to scale the batch or the learning"
            " rate when groups are lost or join: set ReplicaGroups(num_groups=...) or the environment variable"
            " NUM_REPLICA_GROUPS, or keep the per-group batch and the learning rate with"
            " ElasticPolicy(batch='keep_local', lr_scaling='none')"
        )
    if policy.batch != "keep_global":
        return
    if device_batch is None:
        raise ValueError(
            "ElasticPolicy(batch='keep_global') with replica groups needs the training DataLoader's batch_size (it"
            " changes gradient accumulation when groups are lost or join); the loader has none (a batch sampler of its"
            " own?): give it a batch_size or use ElasticPolicy(batch='keep_local')"
        )
    bad = [n for n in range(min_replicas, num_groups + 1) if (num_groups * accumulate) % n]
    if bad:
        raise ValueError(_keep_global_error(bad[0], num_groups, group_size, device_batch, accumulate, min_replicas))


def _keep_global_error(n: int, groups: int, size: int, batch: int, acc: int, min_replicas: int | None) -> str:
    reference = groups * size * batch * acc
    per_batch = batch * size * n
    where = (
        f"for every number of live groups from min_replicas={min_replicas} to num_groups={groups}"
        if (min_replicas is not None)
        else f"at {n} live groups"
    )
    # An accumulation that serves every n from min_replicas: a multiple of n / gcd(n, groups) for each of them.
    low = min_replicas if min_replicas is not None else n
    unit = math.lcm(*(m // math.gcd(m, groups) for m in range(min(low, n), groups + 1)))
    fits = math.ceil(acc / unit) * unit
    higher = next(
        (m for m in range(min(low, n) + 1, groups + 1) if all((groups * acc) % k == 0 for k in range(m, groups + 1))),
        groups,
    )
    return (
        f"ElasticPolicy(batch='keep_global') keeps the global batch of the full membership, {reference} samples"
        f" (num_groups {groups} x ranks per group {size} x per-device batch {batch} x accumulate_grad_batches {acc}),"
        f" {where}; at {n} live groups the accumulation would be {reference} / (per-device batch {batch} x ranks per"
        f" group {size} x {n} groups) = {reference / per_batch:g}, not whole (the rule: accumulate_grad_batches ="
        f" global batch / (per-device batch x ranks per group x live groups)). Set Trainer(accumulate_grad_batches="
        f"{fits}) (a multiple of {unit} divides at every membership), ReplicaGroups(min_replicas={higher}), or use"
        " ElasticPolicy(batch='keep_local') to keep the per-group batch as torchft does (the global batch then"
        " follows the live groups)"
    )


def replica_policy_message(before: ReplicaBatchPlan, after: ReplicaBatchPlan, *, first: bool, warmup_steps: int) -> str:
    """``lightning-ft: replica groups 3 -> 2 live (of 3): gradient accumulation 2 -> 3, global batch 48
    (unchanged), LR x1.00 (unchanged)``: the console line of a membership change (group rank 0). ``first``: the first
    quorum of the fit (``before`` is then what the fit started with)."""

    def change(name: str, old: object, new: object) -> str:
        return f"{name} {new} (unchanged)" if old == new else f"{name} {old} -> {new}"

    groups = f"{after.live_groups}" if first else f"{before.live_groups} -> {after.live_groups}"
    lr = change("LR", f"x{before.lr_scale:.2f}", f"x{after.lr_scale:.2f}")
    if before.lr_scale != after.lr_scale and warmup_steps > 0:
        lr += f" (ramped in over {warmup_steps} steps)"
    return (
        f"lightning-ft: replica groups {groups} live (of {after.num_groups}):"
        f" {change('gradient accumulation', before.accumulate_grad_batches, after.accumulate_grad_batches)},"
        f" {change('global batch', before.global_batch, after.global_batch)}, {lr}"
    )
