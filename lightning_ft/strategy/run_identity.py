"""What "this run" is, for auto-resume: the identity written into every checkpoint's metadata and the live state of
the process.

Auto-resume (:mod:`lightning_ft.strategy.auto_resume`) resumes a checkpoint only when it belongs to this run:

- **Never older than the live state of the process.** Once a LightningModule object or a Trainer has trained in this
  process (a ``fit`` of it ended, however, at a global step above 0), a later ``fit`` of either does not auto-resume:
  it continues from the live state, as Lightning does (:func:`mark_trained`, :func:`trained_in_process`). A restart
  is a new process.
- **A restart's, not this process's.** Once this process has saved a model's checkpoint into a folder, or a ``fit``
  of it over that folder reached a step, a later ``fit`` of the same model (its identity, below) in this process (a
  new model object and Trainer: a hyperparameter loop, a notebook cell run again, a retry after an error) does not
  auto-resume from that folder, nor from the memory tier's copies of that run: what is there was written, or
  already resumed, by this process, and the fit starts from its model's state, as under ``DDPStrategy``
  (:func:`mark_folders_used`, :func:`folder_used`). A restart (torchrun's, a requeue, a relaunch) is a new process
  and resumes; ``fit(ckpt_path=...)`` loads what it names; a retry after a fit that failed before its first step
  resumes as that fit would have.
- **The same model.** Every checkpoint records :func:`module_identity` (``run_identity`` in its metadata): the
  LightningModule's class name, a digest of its parameters' names in the checkpoint's state dict (not the module's
  attribute paths: a layout's wrappers do not make another model), global shapes and dtypes, and (recorded, not
  compared) a digest of its hyperparameters. A checkpoint whose class or parameters differ from the live module's is
  another experiment's (:func:`identity_mismatch`; of the same class, compared by its own state dict first:
  :func:`checkpoint_mismatch`): it is named in one message and left alone, unless
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parameter import is_lazy

from lightning_ft import _compat
from lightning_ft._compat import DTensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "RUN_ID_ENV",
    "checkpoint_mismatch",
    "folder_used",
    "forget_folders_used",
    "identity_mismatch",
    "mark_folders_used",
    "mark_trained",
    "module_identity",
    "state_dict_difference",
    "state_dict_index",
    "trained_in_process",
]

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


_USED: list[tuple[int, str, dict[str, Any] | None]] = []
"""The checkpoint folders this process saved into or trained over, each with the identity of its model: ``(pid,
folder, identity)``. A forked child is another process: entries of its parent's pid do not count in it."""


def _folder_key(folder: str | os.PathLike[str]) -> str:
    text = os.fspath(folder)
    if "://" in text:  # an object store URL: as written
        return text.rstrip("/")
    return os.path.realpath(text)


def mark_folders_used(folders: list[Any], identity: dict[str, Any] | None) -> None:
    """Record that this process saved a checkpoint of the model of ``identity`` (:func:`module_identity`) into
    ``folders``, or that a ``fit`` of it over ``folders`` (its checkpoint folders) reached a step. Every rank calls it,
    at each save and at the end of such a fit."""
    pid = os.getpid()
    for folder in folders:
        entry = (pid, _folder_key(folder), identity)
        if entry not in _USED:
            _USED.append(entry)


def forget_folders_used() -> None:
    """Forget every :func:`mark_folders_used` of this process: what a new process starts with. For tests that stand a
    relaunch in the same process."""
    _USED.clear()


def folder_used(folder: Any, identity: dict[str, Any] | None) -> bool:
    """Whether this process saved into, or trained over, ``folder`` with the model of ``identity``
    (:func:`mark_folders_used`): the same class and parameters (:func:`identity_mismatch`'s comparison; a side without
    an identity matches any)."""
    pid, key = os.getpid(), _folder_key(folder)
    for owner, used, recorded in _USED:
        if owner != pid or used != key:
            continue
        if recorded is None or identity is None or _differs(recorded, identity) is None:
            return True
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
    "parameters": digest or None}``. The parameter digest covers each parameter's name in the checkpoint's state dict
    (:func:`~lightning_ft._compat.state_dict_names`: ``torch.distributed.checkpoint``'s names for DTensor models,
    ``Module.state_dict()``'s otherwise), global shape (a DTensor's full shape) and dtype; ``parameters=False``
    (pipeline stages, whose parameters per rank depend on the layout) or a parameter not yet materialized (a lazy
    module before its first forward) leaves it out. ``None`` without a module."""
    if module is None:
        return None
    cls = type(module)
    hparams = getattr(module, "hparams", None)
    params = None
    named = list(module.named_parameters()) if parameters else []
    # A lazy module's parameters have no shape before its first forward: then nothing is compared on them.
    if parameters and not any(is_lazy(p) for _, p in named):
        # The names the checkpoint's state dict uses, not the module's attribute paths: wrappers that depend on the
        # layout (activation checkpointing applied only with data parallel, torch.compile, FSDP) do not make another
        # model. A plain module's are its own names: the digest is the one earlier releases recorded.
        distributed = any(isinstance(p, DTensor) for _, p in named)
        params = _digest(
            [
                [fqn, list(p.shape), str(p.dtype)]
                for name, p in named
                for fqn in _compat.state_dict_names(module, name, distributed=distributed)
            ]
        )
    return {
        "module": cls.__qualname__,  # not its module: `python train.py` and `python -m pkg.train` are one run
        "hparams": _digest(_plain(dict(hparams))) if hparams else None,
        "parameters": params,
    }


def state_dict_index(module: pl.LightningModule | None) -> dict[str, tuple[str, list[int]]] | None:
    """What a checkpoint of ``module`` records of its state dict, as
    :func:`~lightning_ft.checkpoint.discovery.read_state_index` reads it back: ``{name: (dtype, global shape)}`` for
    every tensor of ``module.state_dict()``, by its name in the checkpoint (the rules of :func:`module_identity`).
    ``None`` without a module, or while a parameter is not materialized. Not collective: nothing is gathered."""
    if module is None:
        return None
    entries = module.state_dict(keep_vars=True)
    distributed = any(isinstance(v, DTensor) for v in entries.values())
    index: dict[str, tuple[str, list[int]]] = {}
    for key, value in entries.items():
        if not isinstance(value, torch.Tensor):
            continue
        if is_lazy(value):
            return None
        for name in _compat.state_dict_names(module, key, distributed=distributed):
            index[name] = (str(value.dtype).removeprefix("torch."), list(value.shape))
    return index


_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def state_dict_difference(
    saved: dict[str, tuple[str, list[int]]], live: dict[str, tuple[str, list[int]]]
) -> str | None:
    """The first difference between a checkpoint's state dict (``saved``) and the live model's (``live``, both as
    :func:`state_dict_index` gives them), in words; ``None`` when they hold the same names, dtypes and shapes."""
    only_saved = [name for name in saved if name not in live]
    only_live = [name for name in live if name not in saved]
    if only_saved or only_live:

        def bare(names: list[str]) -> list[str]:
            for wrapper in _WRAPPERS:
                names = [n.replace(wrapper, "") for n in names]
            return sorted(names)

        hint = ""
        if bare(list(saved)) == bare(list(live)):
            hint = (
                " (the same names but for a wrapper: torch.compile, activation checkpointing or FSDP applied"
                " otherwise than when it was saved; apply it as then to resume this checkpoint)"
            )
        if only_saved:
            dtype, shape = saved[only_saved[0]]
            return f"the checkpoint holds {only_saved[0]!r} ({dtype} {shape}), this model does not{hint}"
        dtype, shape = live[only_live[0]]
        return f"this model holds {only_live[0]!r} ({dtype} {shape}), the checkpoint does not{hint}"
    for name, entry in saved.items():
        if tuple(entry) != tuple(live[name]):
            return f"{name!r} is {entry[0]} {entry[1]} in the checkpoint, {live[name][0]} {live[name][1]} in this model"
    return None


def checkpoint_mismatch(
    metadata: dict[str, Any],
    saved_index: dict[str, tuple[str, list[int]]],
    live: dict[str, Any] | None,
    live_index: Callable[[], dict[str, tuple[str, list[int]]] | None],
) -> str | None:
    """Why the checkpoint with ``metadata`` and state-dict index ``saved_index`` is not this run's, or ``None``.

    :func:`identity_mismatch`, except that a checkpoint of the same class whose parameter digest differs is compared by
    its own state dict with the live one (``live_index()``, computed only then): one that holds exactly this model's
    names, dtypes and shapes is this run's (a checkpoint of an earlier release, whose digest took the module's
    attribute paths, wrappers included); otherwise the reason names the first difference."""
    reason = identity_mismatch(metadata, live)
    if reason is None or live is None or metadata["run_identity"].get("module") != live.get("module"):
        return reason
    current = live_index()
    if current is None or not saved_index:
        return reason
    difference = state_dict_difference(saved_index, current)
    return None if difference is None else f"its parameters differ from this model's: {difference}"


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
    return _differs(saved, live)


def _differs(saved: dict[str, Any], live: dict[str, Any]) -> str | None:
    if saved.get("module") != live.get("module"):
        return f"it was written by a {saved.get('module')}, this run trains a {live.get('module')}"
    # The hyperparameters are recorded, not compared: a relaunch of the same run may change a batch size or a learning
    # rate on purpose (elastic resume, docs/elastic.md).
    if saved.get("parameters") and live.get("parameters") and saved["parameters"] != live["parameters"]:
        return "its parameters differ from this model's (names, shapes or dtypes)"
    return None
