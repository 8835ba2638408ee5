"""What "this run" is, for auto-resume: the identity written into every checkpoint's metadata and the live state of
the process.

Auto-resume (:mod:`lightning_ft.strategy.auto_resume`) resumes a checkpoint only when it belongs to this run:

- **Never older than the live state of the process.** Once a LightningModule object or a Trainer has trained in this
  process (a ``fit`` of it ended, however, at a global step above 0), a later ``fit`` of either does not auto-resume:
  it continues from the live state, as Lightning does (:func:`mark_trained`, :func:`trained_in_process`). A restart
  is a new process.
- **The same model.** Every checkpoint records :func:`module_identity` (``run_identity`` in its metadata): the
  LightningModule's class name, a digest of its parameters' names, global shapes and dtypes, and (recorded, not
  compared) a digest of its hyperparameters. A checkpoint whose class or parameters differ from the live module's is
  another experiment's (:func:`identity_mismatch`): it is named in one message and left alone, unless
  ``LIGHTNING_FT_RUN_ID`` names the run the checkpoint recorded (the user says it is this run). A checkpoint without
  an identity (an older release's, another strategy's file) stays a candidate.

World size, mesh, batch size and hyperparameters are not compared: a relaunch at another world size, or with another
per-device batch or learning rate, is the same run (elastic resume, docs/elastic.md). Two experiments of the same model
that differ only in hyperparameters are told apart by their checkpoint folder (``ModelCheckpoint(dirpath=...)``).
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from typing import TYPE_CHECKING, Any

from torch.nn.parameter import is_lazy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RUN_ID_ENV", "identity_mismatch", "mark_trained", "module_identity", "trained_in_process"]

RUN_ID_ENV = "LIGHTNING_FT_RUN_ID"

_TRAINED: weakref.WeakSet[Any] = weakref.WeakSet()
"""The LightningModules and Trainers that trained in this process (a ``fit`` ended at a global step above 0)."""


def mark_trained(*objects: Any) -> None:
    """Record that ``objects`` (a Trainer, its LightningModule) hold live training state in this process."""
    for obj in objects:
        if obj is not None:
            try:
                _TRAINED.add(obj)
            except TypeError:  # not weak-referenceable (a test double): nothing to remember
                pass


def trained_in_process(*objects: Any) -> bool:
    """Whether any of ``objects`` trained in this process (:func:`mark_trained`)."""
    for obj in objects:
        try:
            if obj is not None and obj in _TRAINED:
                return True
        except TypeError:
            pass
    return False


def _plain(value: Any) -> Any:
    """A JSON value that is the same in every process for the same hyperparameter: plain values as they are, anything
    else by its type's name (an object's ``repr`` may carry its address, which changes at every launch)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def module_identity(module: pl.LightningModule | None, *, parameters: bool = True) -> dict[str, Any] | None:
    """The identity of ``module`` a checkpoint records: ``{"module": class qualname, "hparams": digest or None,
    "parameters": digest or None}``. The parameter digest covers each parameter's name, global shape (a DTensor's
    full shape) and dtype; ``parameters=False`` (pipeline stages, whose parameters per rank depend on the layout) or a
    parameter not yet materialized (a lazy module before its first forward) leaves it out. ``None`` without a
    module."""
    if module is None:
        return None
    cls = type(module)
    hparams = getattr(module, "hparams", None)
    params = None
    named = list(module.named_parameters()) if parameters else []
    # A lazy module's parameters have no shape before its first forward: then nothing is compared on them.
    if parameters and not any(is_lazy(p) for _, p in named):
        params = _digest([[name, list(p.shape), str(p.dtype)] for name, p in named])
    return {
        "module": cls.__qualname__,  # not its module: `python train.py` and `python -m pkg.train` are one run
        "hparams": _digest(_plain(dict(hparams))) if hparams else None,
        "parameters": params,
    }


def identity_mismatch(metadata: dict[str, Any], live: dict[str, Any] | None) -> str | None:
    """Why the checkpoint with ``metadata`` is not this run's (the live module's identity ``live``), or ``None``.

    Compared: the class name and the parameter digest (not the hyperparameters: see the module docstring). ``None``
    too when the checkpoint records no identity (an older release), when there is no live identity, and when
    ``LIGHTNING_FT_RUN_ID`` is set and equals the run id the checkpoint recorded."""
    saved = metadata.get("run_identity")
    if not isinstance(saved, dict) or live is None:
        return None
    explicit = os.environ.get(RUN_ID_ENV)
    if explicit and metadata.get("run_id") == explicit:
        return None
    if saved.get("module") != live.get("module"):
        return f"it was written by a {saved.get('module')}, this run trains a {live.get('module')}"
    # The hyperparameters are recorded, not compared: a relaunch of the same run may change a batch size or a learning
    # rate on purpose (elastic resume, docs/elastic.md).
    if saved.get("parameters") and live.get("parameters") and saved["parameters"] != live["parameters"]:
        return "its parameters differ from this model's (names, shapes or dtypes)"
    return None
