"""The user code of the differential scenarios: modules, data, callbacks and a logger, as a Lightning user writes them.

Nothing here imports lightning_ft: the fresh-process reader (``_reader.py``) loads checkpoints with these classes in a
process that never imported it, as a user's inference script does. ``digest`` names a state bitwise, for comparing
weights between the two strategies.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter, OrderedDict, namedtuple
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

# Lightning's own scan, the one WandbLogger, MLFlowLogger and NeptuneLogger run in ``after_save_checkpoint`` to pick the
# checkpoints to upload (Lightning 2.5.0, 2.6.6). A private name, used here on purpose: the scenario is that logger.
from lightning.pytorch.loggers.utilities import _scan_checkpoints
from torch import nn
from torch.utils.data import DataLoader, Dataset

# A score that goes up and down, logged at every step, so that top-k and "best" choose among the saves as a real
# metric does; it does not depend on the weights, so both strategies see the same scores whatever they compute.
SCORES = (5.0, 3.0, 4.0, 1.0, 6.0, 2.0, 7.0, 0.5, 8.0, 2.5, 9.0, 1.5, 6.5, 3.5, 7.5, 4.5)


def digest(value: Any) -> str:
    """A short hash of every tensor in a nested state (dict keys sorted), bitwise: dtype, shape and bytes."""
    h = hashlib.sha256()

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{prefix}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}.{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(f"{prefix}[{i}]", item)
        else:
            h.update(f"{prefix}={v!r}".encode())

    walk("", value)
    return h.hexdigest()[:16]


def steps_per_epoch() -> int:
    return 4


class Vectors(Dataset):
    """Fixed points: ``steps_per_epoch()`` steps of batch 4 per epoch per rank at any process count."""

    def __init__(self, n: int | None = None, dim: int = 4, seed: int = 0) -> None:
        n = n if n is not None else 4 * steps_per_epoch() * int(os.environ.get("WORLD_SIZE", "1"))
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class DiffModel(L.LightningModule):
    """A small regressor with Adam and a step scheduler, so optimizer and scheduler state matter at resume."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = nn.Sequential(nn.Linear(4, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)
        self.fit_start_step: int | None = None
        self.train_start_weights: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("score", SCORES[self.global_step % len(SCORES)])
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def on_train_start(self) -> None:
        # What the restore left: the step and the weights training starts from.
        self.fit_start_step = self.trainer.global_step
        self.train_start_weights = digest(self.state_dict())

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    def train_dataloader(self) -> DataLoader:
        # In order: Lightning resumes a plain DataLoader at the start of an epoch, lightning-ft where it stopped, and
        # with a shuffle each draws the order from its own RNG state. The scenarios resume at epoch ends, in order, so
        # that the weights after a resume are comparable bitwise (an uninterrupted run with a shuffle is held bitwise
        # by tests/e2e/test_ddp_equivalence.py).
        return DataLoader(Vectors(), batch_size=4, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(Vectors(n=16, seed=1), batch_size=8)


class ShuffledModel(DiffModel):
    """A shuffled DataLoader: the order of each epoch comes from the run's seed (Lightning's ``PL_GLOBAL_SEED``)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Vectors(), batch_size=4, shuffle=True)


class Encoder:
    """A user object kept in hyperparameters (a fitted encoder, a metric), not on torch's weights-only allowlist."""

    def __init__(self, classes: list[str]) -> None:
        self.classes = classes

    def __repr__(self) -> str:
        return f"Encoder({self.classes})"


class EncoderModel(DiffModel):
    def __init__(self, encoder: Encoder | None = None, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.save_hyperparameters()


class AllowingCheckpointIO(TorchCheckpointIO):
    """A library's own ``CheckpointIO``, given to the Trainer with ``plugins=[...]`` (darts gives its Trainer one): it
    allows the library's classes for the duration of each load, as torch's docs say to, and keeps the paths and
    ``weights_only`` values it was asked to load with."""

    def __init__(self, allowed: list[Any]) -> None:
        self.allowed = allowed
        self.calls: list[tuple[str, Any]] = []

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        self.calls.append((str(path), weights_only))
        if weights_only is False:
            return super().load_checkpoint(path, map_location=map_location, weights_only=False)
        with torch.serialization.safe_globals(self.allowed):
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)


Pair = namedtuple("Pair", ["step", "tag"])

# What the scenarios' scripts allow with ``torch.serialization.add_safe_globals``, as torch's docs say to (Counter and
# OrderedDict are on torch's own list): the reader allows the same.
SAFE_GLOBALS = [Pair, frozenset]


class TypedStateModel(DiffModel):
    """Saves a namedtuple in ``on_save_checkpoint``; records the type it gets back in ``on_load_checkpoint``."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.loaded_pair: Any = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["pair"] = Pair(self.global_step, "saved")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_pair = checkpoint.get("pair")


class TypedStateCallback(Callback):
    """Counts with a Counter and keeps an OrderedDict and a frozenset in its state, as user callbacks do."""

    def __init__(self) -> None:
        self.counts: Any = Counter()
        self.order: Any = OrderedDict()
        self.tags: Any = frozenset()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.counts[f"parity{trainer.global_step % 2}"] += 1
        self.order[str(trainer.global_step)] = trainer.global_step
        self.tags = frozenset(self.tags | {f"epoch{trainer.current_epoch}"})

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts, "order": self.order, "tags": self.tags}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counts, self.order, self.tags = state_dict["counts"], state_dict["order"], state_dict["tags"]


class HookOrder(Callback):
    """Records the order of restore and hooks, and the state it holds when ``on_fit_start`` reads it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.steps_seen = 0
        self.seen_at_fit_start: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.calls.append("setup")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.calls.append("on_fit_start")
        self.seen_at_fit_start = self.steps_seen

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.calls.append("on_train_start")

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps_seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append("load_state_dict")
        self.steps_seen = state_dict["steps_seen"]


class UploadViewLogger(Logger):
    """A logger that uploads checkpoints as ``WandbLogger(log_model="all")`` does: at each ``after_save_checkpoint`` it
    runs Lightning's ``_scan_checkpoints`` and "uploads" what it returns. Records what it would upload and whether each
    file loads right then (``torch.load(weights_only=True)``)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.logged_model_time: dict[str, float] = {}
        self.calls: list[list[dict[str, Any]]] = []

    @property
    def name(self) -> str:
        return "upload-view"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        uploads = []
        for mtime, path, score, tag in _scan_checkpoints(checkpoint_callback, self.logged_model_time):
            self.logged_model_time[path] = mtime
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
                step, weights, loads = loaded.get("global_step"), digest(loaded.get("state_dict")), True
            except Exception as e:  # what the upload would carry: a file that does not load
                step, weights, loads = type(e).__name__, None, False
            score = None if score is None else float(score)
            uploads.append(
                {
                    "path": Path(path).relative_to(self.folder).as_posix(),
                    "score": score,
                    "tag": tag,
                    "loads": loads,
                    "step": step,
                    "weights": weights,
                }
            )
        self.calls.append(uploads)


class VersionedNorm(nn.BatchNorm1d):
    """A BatchNorm that records the module version each load hands it (``state_dict._metadata``), as BatchNorm itself
    reads it to upgrade old checkpoints."""

    versions_seen: list[Any]

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: dict, *args: Any) -> None:
        self.__dict__.setdefault("versions_seen", []).append(local_metadata.get("version"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


class ReplicaStateModel(DiffModel):
    """State whose replicas differ between data-parallel ranks: BatchNorm statistics (each rank normalizes its own
    batches) and a memory bank of ``bank_rows`` x 1024 float32 (4 MiB at 1024 rows) where each step writes one row
    from the rank's own batch. Records what each load hands the module."""

    def __init__(self, hidden: int = 8, lr: float = 0.05, bank_rows: int = 1024) -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.backbone = nn.Sequential(nn.Linear(4, hidden), VersionedNorm(hidden), nn.Tanh())
        self.register_buffer("bank", torch.zeros(bank_rows, 1024))
        self.loaded_state_dict_type: str | None = None
        self.validation_start: dict[str, str] | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.bank[self.global_step % len(self.bank)] = batch[0].sum()
        return super().training_step(batch, batch_idx)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_state_dict_type = type(checkpoint["state_dict"]).__name__

    def edited_state(self) -> dict[str, str]:
        """Digests of the three tensors a checkpoint edit changes."""
        return {
            "running_mean": digest(self.backbone[1].running_mean),
            "bank": digest(self.bank),
            "head.weight": digest(self.head.weight),
        }

    def on_validation_start(self) -> None:
        self.validation_start = self.edited_state()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Vectors(n=8, seed=1), batch_size=4)
