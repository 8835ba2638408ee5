# examples/replica_groups.py: one replica group per torchrun (docs/replica-groups.md runs three on one machine)
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from quickstart import Regressor  # examples/quickstart.py's LightningModule: your own, unchanged

from lightning_ft import ElasticFT3D, ReplicaGroups

if __name__ == "__main__":
    trainer = L.Trainer(
        # The lighthouse, this group's id and the number of groups come from TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID
        # and NUM_REPLICA_GROUPS. address: every group runs on this machine (leave it out on a cluster).
        strategy=ElasticFT3D(replica_groups=ReplicaGroups(address="127.0.0.1")),
        max_steps=1500,
        accumulate_grad_batches=2,  # the global batch of 3 groups is kept at 2 and 1 live groups
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=100, save_last=True)],
    )
    trainer.fit(Regressor())
