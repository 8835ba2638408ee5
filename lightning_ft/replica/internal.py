"""What the strategy uses from the replica package beyond its public configuration (imports torchft)."""

from lightning_ft._torchft_native import import_torchft

import_torchft()  # first, before the modules below import it: torchft's Rust INFO lines off unless asked for

from lightning_ft.replica.checkpoint_owner import checkpoint_writer, live_peers  # noqa: E402
from lightning_ft.replica.duplicate_id import DuplicateReplicaError, refuse_a_live_duplicate  # noqa: E402
from lightning_ft.replica.gradient_sync import GradientSync, replica_comm_hook  # noqa: E402
from lightning_ft.replica.replica_groups import ResolvedReplicaGroups  # noqa: E402
from lightning_ft.replica.replica_sync import ReplicaSync  # noqa: E402
from lightning_ft.replica.sharded_sync import ShardedSync  # noqa: E402

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
