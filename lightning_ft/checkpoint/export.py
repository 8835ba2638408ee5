"""Leaving lightning-ft: one plain Lightning ``.ckpt`` file from a committed checkpoint, for ``lightning-ft export``.

:func:`export_checkpoint` gathers every model tensor from its shards into a full tensor and writes one ``torch.save``
file that ``LightningModule.load_from_checkpoint`` and plain ``torch.load(..., weights_only=True)`` read. With
``full=True`` it also writes optimizer states (keyed by parameter position, as ``optimizer.state_dict()`` is), LR
schedulers, the loop state, callback states (rank 0's) and everything else Lightning saved, so that
``Trainer.fit(ckpt_path=...)`` under ``DDPStrategy`` resumes from it. The position of lightning-ft's resumable
samplers inside an epoch is left out (:func:`~lightning_ft.checkpoint.single_file.without_sampler_states`): only they
read it, and Lightning refuses loader states its own DataLoaders cannot take (it restarts an epoch interrupted in the
middle from the epoch's first batch, with a warning); the state of a loader that is stateful by itself is kept.

The file is written one tensor at a time (:func:`~lightning_ft.checkpoint.torch_file.save_streaming`): each tensor
is assembled from its shards, checked against its checksums, written, and released, so the state may be larger than
the memory of the exporting process. Every non-tensor value is turned into plain Python values (an
``argparse.Namespace`` into a dict, a path into a string, an enum into its value, numpy into lists and numbers),
because ``weights_only`` loading refuses anything else.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.commit import read_document
from lightning_ft.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UncommittedCheckpointError,
    UnsafeCheckpointError,
)
from lightning_ft.checkpoint.load import load_checkpoint
from lightning_ft.checkpoint.safe_load import allow_code, globals_to_allow, safe_globals_for, safe_globals_option
from lightning_ft.checkpoint.shard_reader import ShardReader
from lightning_ft.checkpoint.single_file import file_version, is_checkpoint_file, what_is_there, without_sampler_states
from lightning_ft.checkpoint.storage.registry import storage_for_path
from lightning_ft.checkpoint.torch_file import TensorSlot, can_stream, save_streaming

__all__ = ["export_checkpoint", "export_state_dict", "exported_checkpoint"]

_MODEL_KEYS = ("state_dict", "model")
_OWN_CALLBACKS = ("lightning_ft.",)
"""Callback states of lightning-ft's own callbacks, which mean nothing to another strategy."""


_TRAINING_STATE_KEYS = ("optimizer_states", "lr_schedulers", "loops", "callbacks")
"""Top-level keys of a Lightning checkpoint that only resuming training reads: ``--full`` writes them; the plain
export writes every other key, the module's own (what its ``on_save_checkpoint`` added) included."""


def _plain(obj: Any) -> Any:
    """Values that ``torch.load(weights_only=True)`` accepts: containers, primitives, tensors (and slots for them),
    and objects the checkpoint stored pickled, which it accepts once their globals are allowed."""
    if isinstance(obj, (str, int, float, bool, type(None), torch.Tensor, TensorSlot, torch.dtype)):
        return obj
    if isinstance(obj, argparse.Namespace):
        return _plain(vars(obj))
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if isinstance(obj, enum.Enum):
        return _plain(obj.value)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # the checkpoint restores it as itself
        return _plain({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    # An object stored pickled (allowed in this process, or its load would have failed) is written as itself: the
    # file needs the same allowed globals to load, as the checkpoint did; a text stand-in would break the module's
    # __init__ (pytorch-forecasting asserts its loss is a Metric).
    return obj


def _module_keys(state: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys of ``state`` that are neither training state nor written by the export itself: the
    module's own (pytorch-forecasting's ``__special_save__``), the datamodule's, the precision plugin's."""
    written = {"state_dict", "hyper_parameters", "hparams_name", "pytorch-lightning_version", "epoch", "global_step"}
    return {str(k): v for k, v in state.items() if k not in written and k not in _TRAINING_STATE_KEYS}


def _objects_hold_tensors(obj: Any) -> bool:
    """Whether a value of ``obj`` other than a :class:`TensorSlot` holds tensor data (a tensor, or an object stored
    pickled with tensors inside, as a torchmetrics loss): a streamed ``torch.save`` would write it without its data."""
    if isinstance(obj, TensorSlot) or isinstance(obj, (str, int, float, bool, type(None), torch.dtype)):
        return False
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_objects_hold_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_objects_hold_tensors(v) for v in obj)
    return _holds_tensors(obj)


def _holds_tensors(obj: Any) -> bool:
    """Whether pickling ``obj`` reaches a tensor or a storage."""
    found: list[bool] = []

    class _Finder(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, (torch.Tensor, torch.UntypedStorage, torch.storage.TypedStorage)):
                found.append(True)
                return "tensor"
            return None

    _Finder(io.BytesIO()).dump(obj)
    return bool(found)


def _by_position(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``get_optimizer_state_dict``) keyed by position instead, as
    ``torch.optim.Optimizer.state_dict()`` is (positions count across parameter groups, in order)."""
    groups = optimizer_state.get("param_groups", [])
    if all(isinstance(p, int) for g in groups for p in g.get("params", [])):
        return optimizer_state
    index: dict[Any, int] = {}
    new_groups = []
    for group in groups:
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        new_groups.append({**group, "params": ids})
    state = {index[name]: values for name, values in optimizer_state.get("state", {}).items() if name in index}
    return {"state": state, "param_groups": new_groups}


def _model_state(state: dict[str, Any], rank_states: list[Any], path: Path) -> dict[str, Any]:
    model = next((state[k] for k in _MODEL_KEYS if isinstance(state.get(k), dict)), None)
    if model is not None:
        return model
    # Pipeline stages: each rank saved the layers of its stage; data-parallel replicas of a stage hold the same values.
    merged: dict[str, Any] = {}
    for rank_state in rank_states:
        stage = (rank_state or {}).get("stage", {}) if isinstance(rank_state, dict) else {}
        for name, value in stage.get("state_dict", {}).items():
            merged.setdefault(name, value)
    if not merged:
        raise CheckpointError(f"checkpoint {path}: no model state found (looked for keys {list(_MODEL_KEYS)})")
    return merged


def _pickled(encoded: Any, path: str = "") -> list[tuple[str, bytes]]:
    """``(key, payload)`` of every object stored pickled in the encoded value ``encoded``, keyed as
    :func:`json_codec.decode` names them in its errors."""
    if isinstance(encoded, list):
        return [p for i, v in enumerate(encoded) for p in _pickled(v, f"{path}/{i}" if path else str(i))]
    if not isinstance(encoded, dict):
        return []
    tag = encoded.get(json_codec.TAG)
    if tag is None:
        return [p for k, v in encoded.items() for p in _pickled(v, f"{path}/{k}" if path else str(k))]
    if tag == "pickle":
        return [(path or "value", base64.b64decode(encoded["data"]))]
    if tag == "dict":
        items = [(json_codec.decode(k), v) for k, v in encoded["items"]]
        return [p for k, v in items for p in _pickled(v, f"{path}/{k}" if path else str(k))]
    if tag == "tuple":
        return _pickled(list(encoded["items"]), path)
    if tag in ("namespace", "dataclass"):
        return _pickled(encoded["fields"], path)
    return []


def _every_refusal(document: dict[str, Any], path: Path, first: UnsafeCheckpointError) -> UnsafeCheckpointError:
    """One refusal that names every object of the checkpoint stored pickled whose globals are not allowed in this
    process, and the ``--safe-globals`` value that allows them all, instead of the first object alone (a library's
    hyperparameters hold several such objects: the user learnt one more per run). The globals are the list the
    save-time warning and the refusal at load name (:func:`~lightning_ft.checkpoint.safe_load.globals_to_allow`)."""
    encoded = [document["state"], *document["rank_states"], document["metadata"]]
    needs: dict[str, list[str]] = {}
    for key, data in (p for value in encoded for p in _pickled(value)):
        try:
            blocked = safe_globals_for(io.BytesIO(data))[1]
        except Exception:  # noqa: BLE001 - not a torch.save payload: the decode reports it where it meets it
            continue
        if blocked:
            needs.setdefault(key, globals_to_allow(data, blocked))
    first_names = getattr(first, "globals_to_allow", None) or []
    return _export_refusal(
        path, sorted({n for names in needs.values() for n in names} | set(first_names)), list(needs), first
    )


def _export_refusal(
    path: Path, names: list[str] | None, keys: list[str], first: UnsafeCheckpointError
) -> UnsafeCheckpointError:
    """The export's refusal: the globals to allow, as ``--safe-globals`` (which reads them back) and as Python."""
    if not names:
        return first
    stored = f" stores {len(keys)} object(s) pickled ({', '.join(keys)}) that" if keys else ""
    return UnsafeCheckpointError(
        f"checkpoint {path}{stored} need(s) {', '.join(names)}, which are not allowed globals in this process, so"
        " lightning-ft does not unpickle them. If you trust these classes, allow them for the export:"
        f" `lightning-ft export --safe-globals {safe_globals_option(names)} ...` (in Python: `{allow_code(names)}`"
        " before the call)"
    )


def export_checkpoint(
    path: str | os.PathLike, out: str | os.PathLike, *, full: bool = False, progress: bool = False
) -> Path:
    """Write committed checkpoint ``path`` as one plain Lightning ``.ckpt`` file at ``out``; returns ``out``.

    Always written: ``state_dict`` (full tensors, on CPU), ``hyper_parameters`` (and ``hparams_name``),
    ``pytorch-lightning_version``, ``epoch``, ``global_step`` and every other top-level key that is not training
    state (the module's own, such as pytorch-forecasting's ``__special_save__``, the datamodule's). With ``full``:
    also ``optimizer_states``, ``lr_schedulers``, ``loops`` and ``callbacks`` (rank 0's, without lightning-ft's own).
    Objects the checkpoint stored pickled are written as themselves (reading the file needs their classes allowed, as
    reading the checkpoint did); where one holds tensors the file is written in memory at once instead of one tensor
    at a time. ``progress`` shows a progress bar (bytes written) on stderr. Not collective: run it in one process.

    Raises:
        CheckpointError: the checkpoint is not committed, fails a checksum, holds no model state, or ``full`` is asked
            of a pipeline-parallel checkpoint (its optimizer states are per stage); an ``UnsafeCheckpointError`` where
            it stores objects whose classes are not allowed in this process, naming every such object and class and
            the ``--safe-globals`` value of ``lightning-ft export`` that allows them.
    """

    path = Path(path)
    if not path.is_dir() and not is_checkpoint_file(path):
        raise UncommittedCheckpointError(what_is_there(path))
    if path.is_file() and file_version(path) != 1:
        # Lightning's own file: its dict, as Lightning loads it (edits included), is what is exported.
        try:
            loaded = load_checkpoint(path, collective=False)
        except UnsafeCheckpointError as error:
            raise _export_refusal(path, getattr(error, "globals_to_allow", None), [], error) from error
        state, rank_states, metadata = loaded.state, [loaded.rank_state], loaded.metadata
        reader = None
    else:
        state, rank_states, metadata, reader = _read_folder(path)
    return _export(state, rank_states, metadata, path, Path(out), full=full, reader=reader, progress=progress)


def _read_folder(path: Path) -> tuple[Any, list[Any], dict[str, Any], ShardReader]:
    """A folder's (or a version-1 file's) state with :class:`TensorSlot` placeholders, read from its document."""
    document = read_document(path)
    reader = ShardReader(path, document, storage_for_path(path), verify_checksums=True)
    records = document["tensors"]

    def slot(key: str, _: str) -> TensorSlot:
        record = records.get(key)
        if record is None:
            raise CorruptCheckpointError(f"checkpoint {path}: tensor {key!r} is missing from the index")
        dtype = getattr(torch, record["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"checkpoint {path}: unknown dtype {record['dtype']!r} of {key!r}")
        return TensorSlot(key, dtype, tuple(record["global_shape"]))

    try:
        state = json_codec.decode(document["state"], slot)
        rank_states = [json_codec.decode(r, slot) for r in document["rank_states"]]
        metadata = json_codec.decode(document["metadata"])
    except UnsafeCheckpointError as error:
        raise _every_refusal(document, path, error) from error
    return state, rank_states, metadata, reader


def _export(
    state: Any,
    rank_states: list[Any],
    metadata: dict[str, Any],
    path: Path,
    out: Path,
    *,
    full: bool,
    reader: ShardReader | None,
    progress: bool,
) -> Path:
    import lightning

    state = state if isinstance(state, dict) else {}
    model = _model_state(state, rank_states, path)
    exported: dict[str, Any] = _module_keys(state)
    if full:
        if "state_dict" not in state:
            raise CheckpointError(
                f"checkpoint {path}: --full needs the optimizer states of the whole model; this checkpoint keeps them"
                " per pipeline stage (export without --full writes the weights of every stage)"
            )
        exported.update({str(k): v for k, v in state.items()})
        exported["optimizer_states"] = [_by_position(o) for o in state.get("optimizer_states", [])]
        exported["loops"] = without_sampler_states(state.get("loops", {}))
        callbacks = (rank_states[0] or {}).get("callbacks", {}) if rank_states else {}
        exported["callbacks"] = {k: v for k, v in callbacks.items() if not str(k).startswith(_OWN_CALLBACKS)}
    exported.update(
        {
            "state_dict": {str(k): v for k, v in model.items() if isinstance(v, (TensorSlot, torch.Tensor))},
            "hyper_parameters": state.get("hyper_parameters", metadata.get("hyper_parameters", {})),
            "pytorch-lightning_version": str(state.get("pytorch-lightning_version", lightning.__version__)),
            "epoch": state.get("epoch", metadata.get("epoch", 0)),
            "global_step": state.get("global_step", metadata.get("step", 0)),
        }
    )
    if "hparams_name" in state:
        exported["hparams_name"] = state["hparams_name"]
    exported = _plain(exported)
    return _write(exported, out, reader, progress=progress)


def _write(exported: dict[str, Any], out: Path, reader: ShardReader | None, *, progress: bool) -> Path:
    from tqdm.auto import tqdm

    def produce(slot: TensorSlot) -> torch.Tensor:
        assert reader is not None  # slots come only from a folder's document
        return reader.assemble(slot.key, [0] * len(slot.shape), list(slot.shape))

    # The whole file in memory at once where streaming cannot write it: torch 2.4, or objects that hold tensors,
    # whose data the streamed skeleton would leave out (torch.save numbers their storages among the slots').
    if not can_stream() or _objects_hold_tensors(exported):
        materialized = _materialize(exported, produce)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        torch.save(materialized, tmp)
        os.replace(tmp, out)
        return out
    total = sum(s.nbytes for s in _slots(exported))
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"export {out.name}", disable=not progress) as bar:
        return save_streaming(exported, out, produce, on_written=lambda s: bar.update(s.nbytes))


def _slots(obj: Any) -> list[TensorSlot]:
    if isinstance(obj, TensorSlot):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _slots(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _slots(v)]
    return []


def _materialize(obj: Any, produce: Any) -> Any:
    if isinstance(obj, TensorSlot):
        return produce(obj)
    if isinstance(obj, dict):
        return {k: _materialize(v, produce) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_materialize(v, produce) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def exported_checkpoint(path: str | os.PathLike, *, weights_only: bool | None = None) -> dict[str, Any]:
    """Committed checkpoint ``path`` as one plain Lightning checkpoint dict, in memory.

    It holds ``state_dict`` (full model tensors, assembled from their shards, on CPU), ``hyper_parameters``,
    ``pytorch-lightning_version``, ``epoch`` and ``global_step`` (and ``hparams_name`` when saved), and every other
    top-level key but the training state (optimizer, schedulers, loops, callbacks), the module's own that its
    ``on_load_checkpoint`` reads included: what ``LightningModule.load_from_checkpoint`` reads. ``weights_only``: as
    :func:`load_checkpoint`. Not collective: one process reads every shard it needs.

    Raises:
        CheckpointError: as :func:`load_checkpoint`, or the checkpoint holds no model state (no ``state_dict`` key).
    """
    import lightning

    loaded = load_checkpoint(path, collective=False, weights_only=weights_only)
    state = loaded.state if isinstance(loaded.state, dict) else {}
    model = next((state[k] for k in _MODEL_KEYS if isinstance(state.get(k), dict)), None)
    metadata = loaded.metadata
    if model is None:
        mesh = metadata.get("mesh") or {}
        why = (
            "a pipeline-parallel checkpoint keeps each stage's weights with the ranks of that stage"
            if (mesh.get("pipeline_parallel") or 1) > 1
            else f"looked for keys {list(_MODEL_KEYS)}"
        )
        raise CheckpointError(f"checkpoint {path}: no model state found ({why})")
    exported = {
        **_plain(_module_keys(state)),
        "state_dict": {str(k): v for k, v in model.items() if isinstance(v, torch.Tensor)},
        "hyper_parameters": _plain(state.get("hyper_parameters", metadata.get("hyper_parameters", {}))),
        "pytorch-lightning_version": str(state.get("pytorch-lightning_version", lightning.__version__)),
        "epoch": _plain(state.get("epoch", metadata.get("epoch", 0))),
        "global_step": _plain(state.get("global_step", metadata.get("step", 0))),
    }
    if "hparams_name" in state:
        exported["hparams_name"] = _plain(state["hparams_name"])
    return exported


def export_state_dict(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """The weights-only export: :func:`export_checkpoint` with ``full=False`` (kept for 0.1.0 callers)."""
    return export_checkpoint(path, out)
