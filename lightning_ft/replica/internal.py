"""What the strategy uses from the replica package beyond its public configuration (imports torchft)."""

from lightning_ft.replica.checkpoint_owner import checkpoint_writer, live_peers
from lightning_ft.replica.duplicate_id import DuplicateReplicaError, refuse_a_live_duplicate
from lightning_ft.replica.gradient_sync import GradientSync, replica_comm_hook
from lightning_ft.replica.replica_groups import ResolvedReplicaGroups
from lightning_ft.replica.replica_sync import ReplicaSync
from lightning_ft.replica.sharded_sync import ShardedSync

__all__ = [
    "DuplicateReplicaError",
    "GradientSync",
    "ReplicaSync",
    "ResolvedReplicaGroups",
    "ShardedSync",
    "checkpoint_writer",
    "live_peers",
    "refuse_a_live_duplicate",
    "replica_comm_hook",
]
