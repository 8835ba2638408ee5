"""Replica-level fault tolerance: survivors keep training when a replica group dies, and a replacement heals from a
live peer (docs/replica-groups.md). Built on torchft (``pip install lightning-ft[replicas]``).

``ReplicaGroups`` is the configuration (``ElasticFT3D(replica_groups=ReplicaGroups(...))``); the modules of this
package are the strategy's parts: :mod:`~lightning_ft.replica.replica_sync` (torchft's Manager behind the seam),
:mod:`~lightning_ft.replica.gradient_sync` (the DDP communication hook), :mod:`~lightning_ft.replica.step_gate`
(a discarded step is not applied nor counted), :mod:`~lightning_ft.replica.heal_state` and
:mod:`~lightning_ft.replica.heal_transport` (copying the live state), :mod:`~lightning_ft.replica.checkpoint_owner`
(which group writes checkpoints; whether a starting group reads one), :mod:`~lightning_ft.replica.one_model` and
:mod:`~lightning_ft.replica.run_configuration` (the groups compare their configuration and state, and agree on a
stop), :mod:`~lightning_ft.replica.lost_writer` (the save a writer lost mid-save left),
:mod:`~lightning_ft.replica.torchft_console` (torchft's console output). Only the configuration imports without
torchft.
"""

from lightning_ft.replica.replica_groups import ReplicaGroups

__all__ = ["ReplicaGroups"]
