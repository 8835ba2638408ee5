"""Small, stateless helpers the strategy uses to collect and apply training state.

Kept apart from ``strategy.py`` so that the strategy reads as the composition it is: RNG states, batch sizes and
learning rates, checkpoint-path checks, and the foreign-checkpoint import.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ft.checkpoint import COMMIT_MARKER, METADATA_FILE, CheckpointError, discovery
from lightning_ft._compat import DTensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

_IMPORT_TIME = time.time()


def process_start_time() -> float:
    """Unix time at which this process started (from ``/proc`` where it exists, else the import time)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORT_TIME


def has_dtensor_parameters(module: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def check_writable_dir(dirpath: Path) -> None:
    """Raise ``ValueError`` unless ``dirpath`` is a writable folder or can be created as one in an existing parent."""
    target = dirpath if dirpath.exists() else dirpath.parent
    if dirpath.exists() and not dirpath.is_dir():
        raise ValueError(f"ModelCheckpoint(dirpath={str(dirpath)!r}): exists and is not a folder")
    if not target.exists():
        raise ValueError(
            f"ModelCheckpoint(dirpath={str(dirpath)!r}): the parent folder {str(target)!r} does not exist;"
            " create it first (on the filesystem all nodes share) or choose another dirpath"
        )
    try:
        # A real write, not os.access: permissions are not the only reason a folder refuses files (read-only mounts,
        # root on a filesystem that still says no).
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as err:
        raise ValueError(
            f"ModelCheckpoint(dirpath={str(dirpath)!r}): cannot write into {str(target)!r} ({err.strerror})"
        ) from err


def collect_rng_states() -> dict[str, Any]:
    return _collect_rng_states(include_cuda=torch.cuda.is_available())


def per_device_batch_size(trainer: pl.Trainer | None) -> int | None:
    if trainer is None:
        return None
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    flat = getattr(loader, "flattened", None) or []
    for dl in flat:
        size = getattr(dl, "batch_size", None)
        if isinstance(size, int):
            return size
    return None


def base_lrs(optimizers: list[torch.optim.Optimizer]) -> list[list[float]]:
    return [[float(g.get("initial_lr", g["lr"])) for g in opt.param_groups] for opt in optimizers]


def is_lightning_ft_checkpoint(path: Path) -> bool:
    """A folder that lightning-ft wrote (committed or not): it holds our metadata, our marker or snapshot data."""
    if not path.is_dir():
        return False
    names = (METADATA_FILE, COMMIT_MARKER, ".snapshot_metadata", "batched")
    return any((path / name).exists() for name in names) or any(p.name.isdigit() for p in path.iterdir())


def resolve_explicit_ckpt_path(path: Path) -> Path:
    """Check a ``ckpt_path`` the user gave (after Lightning resolved ``"last"``/``"best"``) before anything loads."""
    if path.is_symlink():
        target = path.resolve()
        if target.exists() and discovery.is_committed(target):
            return target
        latest = discovery.latest_committed(path.parent)
        if latest is None:
            raise CheckpointError(f"ckpt_path={str(path)!r} points at {str(target)!r}, which is not committed")
        rank_zero_warn(f"{path} points at an uncommitted checkpoint; resuming from {latest.path} instead")
        return latest.path
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist{discovery.newest_alternative(path)}")
    if is_lightning_ft_checkpoint(path) and not discovery.is_committed(path):
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is a lightning-ft checkpoint without its commit marker (its save never"
            f" finished){discovery.newest_alternative(path)}"
        )
    return path


def load_foreign_checkpoint(path: Path, *, parallelized: bool) -> dict[str, Any]:
    """Import a Lightning ``.ckpt`` file, never through unrestricted unpickling."""
    if path.is_dir():
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is a folder but not a lightning-ft checkpoint (no metadata file found)"
        )
    if parallelized:
        raise CheckpointError(
            f"ckpt_path={str(path)!r}: importing a single-file Lightning checkpoint into a parallelized (DTensor)"
            " model is not supported; export it with `lightning-ft export` from a lightning-ft checkpoint instead"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError and friends: refuse, never fall back to full unpickling
        raise CheckpointError(
            f"ckpt_path={str(path)!r} could not be loaded with weights_only=True ({type(err).__name__}: {err});"
            " lightning-ft never loads checkpoints through unrestricted unpickling"
        ) from err


def copy_into(template: Any, saved: Any) -> Any:
    """Copy ``saved`` into the tensors of ``template`` in place (a DTensor's local shard for a DTensor) and return
    ``template`` with ``saved``'s non-tensor values. Used for state that was stored per rank as local tensors."""
    if isinstance(template, torch.Tensor):
        target = template.to_local() if isinstance(template, DTensor) else template
        with torch.no_grad():
            target.copy_(saved.to_local() if isinstance(saved, DTensor) else saved)
        return template
    if isinstance(template, dict) and isinstance(saved, dict):
        out = dict(saved)
        for key, value in template.items():
            if key in saved:
                out[key] = copy_into(value, saved[key])
        return out
    if isinstance(template, (list, tuple)) and isinstance(saved, (list, tuple)) and len(template) == len(saved):
        return type(template)(copy_into(t, s) for t, s in zip(template, saved, strict=True))
    return saved
