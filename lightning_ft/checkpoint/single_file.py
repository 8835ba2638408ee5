"""A lightning-ft checkpoint as one file: the file Lightning itself writes, and the only copy of the state; written by
one process, or by every rank of a data-parallel world together (``checkpoint_format="file"``).

``ElasticFT3D(checkpoint_format="file")`` writes, at the path Lightning asks for, the ``torch.save`` zip file of
Lightning's checkpoint dict, so ``torch.load(path)``, Lightning's ``pl_load``, ``LightningModule.load_from_checkpoint``
and ``os.path.isfile`` work on it, and lightning-ft restores what they read (:func:`load_file`). One top-level key is
added, :data:`RECORD_KEY` (``"lightning_ft"``), that holds no second copy of anything in Lightning's dict:

- ``"marker"``: a JSON string starting with :data:`MARKER_PREFIX` (format version, step, ``full_state``, run id, time,
  the document's crc32): the commit marker (only a rename after the file was durable puts it at a checkpoint path) and
  lightning-ft's proof that it wrote the file, found by :func:`read_marker` without executing the pickle (the opcodes
  of the zip's ``data.pkl`` record, walked with :func:`pickletools.genops`).
- ``"document"``: a JSON string: the run metadata, lightning-ft's per-process state that Lightning does not keep (RNG
  states), the resumable samplers' positions (left out of Lightning's loop state, which other strategies must read),
  and the checksums of the Lightning content (:func:`~lightning_ft.checkpoint.file_checks.content_checksums`).
- ``"entries"``: the tensors of that per-process state.

A load compares the content with the checksums: equal, the file is as saved; different, its zip records are read
against their CRC32s: a damaged file is refused (:class:`CorruptCheckpointError`), an intact one was edited and loads
as Lightning loads it, said once. Version-1 files (the record kept the whole state a second time as JSON, with
``"entries"`` indexed like a folder's shards) are still read through :class:`FileReader`. :class:`FileStorage` is the
storage seam for the format: it writes the file into a save's staging folder (the commit, a rename onto the checkpoint
path, is :mod:`~lightning_ft.checkpoint.file_commit`'s).

Why one module: it is the format's one definition, both sides of it: what the writer puts in the record (the marker,
the document, the entries) is exactly what the marker scan, the document parse and the loads (version 1 included)
read back, and a change to one side must be seen beside the other.
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    FormatVersionError,
    UncommittedCheckpointError,
)
from lightning_ft.checkpoint.file_checks import content_checksums, damaged_records, pickle_record
from lightning_ft.checkpoint.pickle_scan import scan_pickle
from lightning_ft.checkpoint.sampler_positions import sampler_positions, with_sampler_states, without_sampler_states

__all__ = [
    "MARKER_PREFIX",
    "RECORD_KEY",
    "STAGED_NAME",
    "FileReader",
    "FileStorage",
    "is_checkpoint_file",
    "read_file_document",
    "read_marker",
    "what_is_there",
    "without_sampler_states",
]

FORMAT_VERSION = 2
"""The single-file format this release writes (the folder's metadata document has its own version). Version 1 kept a
second copy of the state in the record; this release still reads it."""
READ_VERSIONS = (1, 2)
"""The single-file format versions this release reads."""
RECORD_KEY = "lightning_ft"
"""The top-level key of Lightning's checkpoint dict that holds lightning-ft's record."""
MARKER_PREFIX = '{"lightning_ft_file": '
"""How the marker string begins; what :func:`read_marker` looks for among the pickle's string constants."""
_DOCUMENT_PREFIX = '{"lightning_ft_document": '
STAGED_NAME = "checkpoint.ckpt"
"""The file's name inside the staging folder it is written in before the rename onto the checkpoint path."""


def _torn(path: Path) -> str:
    return (
        f"checkpoint {path} is a truncated or damaged zip archive (its zip directory cannot be read): a damaged copy"
        " of a lightning-ft checkpoint file (its marker is inside)"
    )


def read_marker(path: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of the lightning-ft checkpoint file ``path``, or ``None`` when ``path`` is not one (not a regular
    file, a link, not a zip, no marker: a Lightning ``.ckpt`` of another strategy, say). Executes nothing."""
    scanned = scan_pickle(Path(path), (MARKER_PREFIX,))
    if scanned is None or MARKER_PREFIX not in scanned[2]:
        return None
    try:
        marker = json.loads(scanned[2][MARKER_PREFIX])
    except ValueError:
        return {}
    return marker if isinstance(marker, dict) else {}


def what_is_there(path: str | os.PathLike) -> str:
    """One sentence naming what is at ``path`` when it is not a lightning-ft checkpoint (for ``lightning-ft export``
    and ``inspect``): nothing, a folder, a file that is not a zip archive, a truncated one (a copy of a lightning-ft
    checkpoint or not), a zip that is not a ``torch.save`` file, or a plain ``torch.save`` file. Executes nothing."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return f"checkpoint {path} does not exist"
    if path.is_symlink() and not path.exists():
        return f"{path} is a link to {os.readlink(path)}, which does not exist"
    if path.is_dir():
        return f"{path} is a folder without a commit marker: not a committed lightning-ft checkpoint"
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04":
        return (
            f"{path} is a file of {size} bytes that is not a checkpoint: not a zip archive, so not a file torch.save"
            " writes (nor a lightning-ft checkpoint)"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            info = pickle_record(archive)
        if damaged_records(path):  # a directory read, but records cut short or changed
            raise zipfile.BadZipFile("records fail their CRC32")
    except (zipfile.BadZipFile, OSError, ValueError):
        raw = path.read_bytes()
        ours = MARKER_PREFIX.encode() in raw
        return (
            f"{path} is a truncated or damaged zip archive ({size} bytes: its zip directory or records are missing or"
            " fail their CRC32)"
            + (
                ": a damaged copy of a lightning-ft checkpoint file (its marker is inside); copy it again"
                if ours
                else ": not a readable torch.save file"
            )
        )
    if info is None:
        return f"{path} is a zip archive without a pickled record: not a file torch.save writes"
    return (
        f"{path} is a plain torch.save file ({size} bytes) without lightning-ft's record: not a lightning-ft"
        " checkpoint (a Lightning .ckpt of another strategy, say: read it with torch.load, or resume from it with"
        " fit(ckpt_path=...), which imports it)"
    )


def is_checkpoint_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint file lightning-ft wrote (a regular file holding our marker; see
    :func:`read_marker`). Such a file at a checkpoint path is committed."""
    return read_marker(path) is not None


def _parse_document(path: Path, marker_text: str, text: str | None) -> tuple[int, dict[str, Any]]:
    try:
        marker = json.loads(marker_text)
    except ValueError as e:
        raise CorruptCheckpointError(f"checkpoint {path}: its marker is not valid JSON") from e
    version = marker.get("lightning_ft_file") if isinstance(marker, dict) else None
    if version not in READ_VERSIONS:
        raise FormatVersionError(
            f"checkpoint {path} has file format version {version!r}; this lightning-ft reads versions"
            f" {', '.join(map(str, READ_VERSIONS))}"
        )
    if text is None:
        raise CorruptCheckpointError(f"checkpoint {path}: its metadata document is missing")
    if zlib.crc32(text.encode()) != marker.get("document_crc32"):
        raise CorruptCheckpointError(f"checkpoint {path}: its metadata document does not match the marker's checksum")
    try:
        document = json.loads(text)
    except ValueError as e:
        raise CorruptCheckpointError(f"checkpoint {path}: its metadata document is not valid JSON ({e})") from e
    document.pop("lightning_ft_document", None)
    return version, document


def file_version(path: str | os.PathLike) -> int | None:
    """The file format version of the lightning-ft checkpoint file ``path`` (``None``: not one). Executes nothing."""
    marker = read_marker(path)
    version = marker.get("lightning_ft_file") if marker is not None else None
    return version if isinstance(version, int) else (None if marker is None else -1)


def read_file_document(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check the metadata document of the checkpoint file ``path`` (executes nothing).

    A version-1 file holds the whole folder document (state, index, every rank's state). A version-2 file holds
    lightning-ft's own part only; it is returned in the folder document's shape, with ``state`` ``None`` and
    ``rank_states`` and ``tensors`` empty (Lightning's dict is the state: :func:`load_file` reads it), and
    ``file_format`` 2.

    Raises:
        UncommittedCheckpointError: ``path`` is not a lightning-ft checkpoint file.
        CorruptCheckpointError: the pickled part fails the zip's CRC32, or the document is missing, fails its crc32 or
            is not valid JSON.
        FormatVersionError: a format version this release does not read.
    """
    path = Path(path)
    scanned = scan_pickle(path, (MARKER_PREFIX, _DOCUMENT_PREFIX))
    if scanned is None or MARKER_PREFIX not in scanned[2]:
        raise UncommittedCheckpointError(what_is_there(path))
    info, data, found = scanned
    if info is None:
        raise CorruptCheckpointError(_torn(path))
    if zlib.crc32(data) != info.CRC:
        raise CorruptCheckpointError(f"checkpoint {path}: its pickled state ({info.filename}) fails the zip's CRC32")
    version, document = _parse_document(path, found[MARKER_PREFIX], found.get(_DOCUMENT_PREFIX))
    if version == 1:
        return document
    return {
        "format_version": document.get("format_version"),
        "file_format": version,
        "metadata": document.get("metadata", {}),
        "state": None,
        "rank_states": [],
        "tensors": {},
        "checksums": document.get("checksums", {}),
    }


def file_problems(path: str | os.PathLike) -> list[str]:
    """What :func:`~lightning_ft.checkpoint.verify` reports for a version-2 checkpoint file: the records whose bytes
    fail the zip's CRC32 (``[]``: intact). An edit is not a problem: the file loads as Lightning loads it."""
    damaged = damaged_records(path)
    if not damaged:
        return []
    try:  # the load names the tensors whose bytes changed
        load_file(path)
    except CorruptCheckpointError as e:
        return [str(e)]
    except CheckpointError:
        pass
    return [f"checkpoint {path}: {', '.join(damaged)} fail(s) the zip's CRC32 (damaged)"]


_said: set[tuple[str, str]] = set()


def _say_once(kind: str, path: Path, message: str) -> None:
    if (kind, str(path)) not in _said:
        _said.add((kind, str(path)))
        warnings.warn(message, stacklevel=4)


def _torch_load(path: Path, weights_only: bool) -> Any:
    """Lightning's own load of the file (``torch.load``, memory-mapped) under Lightning's ``weights_only`` rule, or
    the user's ``CheckpointIO`` plugin's (:func:`~lightning_ft.checkpoint.file_reader.load_checkpoint_file`); a file
    that cannot be read is corrupt only where its bytes fail the zip's CRC32."""
    from lightning_ft.checkpoint.file_reader import load_checkpoint_file

    return load_checkpoint_file(path, mmap=True, weights_only=weights_only)


def load_file(
    path: str | os.PathLike, *, weights_only: bool = True, rank: int = 0
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], bool]:
    """Load the version-2 checkpoint file ``path`` as Lightning loads it: ``(checkpoint, rank_state, metadata,
    edited)``. ``checkpoint`` is Lightning's dict as ``torch.load`` returns it (the user's edits included; the
    resumable samplers' positions from the record put back into its loop state; no :data:`RECORD_KEY`);
    ``rank_state`` lightning-ft's per-process state of saved rank ``rank`` modulo the saved world size (RNG states),
    with the ``callbacks`` of Lightning's dict for saved rank 0 and that rank's own from the record for the others;
    ``edited``: the content no longer matches the checksums recorded at the save (said once,
    as a warning). Not collective.

    Raises:
        CorruptCheckpointError: the file's bytes fail the zip's CRC32 (a damaged file), naming the tensors that
            changed.
        UnsafeCheckpointError: with ``weights_only`` (Lightning's default on torch >= 2.6) the file needs globals that
            are not allowed; the message prints the code that allows them.
        CheckpointError: an intact file that cannot be deserialized (the cause is named).
    """
    path = Path(path)
    try:
        loaded = _torch_load(path, weights_only)
    except CorruptCheckpointError as e:
        scanned = scan_pickle(path, (MARKER_PREFIX,))
        if scanned is not None and scanned[0] is None and MARKER_PREFIX in scanned[2]:
            raise CorruptCheckpointError(_torn(path)) from e
        raise
    if not isinstance(loaded, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(loaded).__name__}, not Lightning's checkpoint dict")
    record = loaded.pop(RECORD_KEY, None)
    document: dict[str, Any] | None = None
    entries: dict[str, Any] = {}
    if isinstance(record, dict) and isinstance(record.get("marker"), str):
        try:
            _, document = _parse_document(path, record["marker"], record.get("document"))
        except CheckpointError:
            document = None
        entries = record.get("entries") if isinstance(record.get("entries"), dict) else {}
    actual = content_checksums({**loaded, RECORD_KEY: {"entries": entries}})
    edited = document is None or actual != document.get("checksums")
    if edited:
        damaged = damaged_records(path)
        if damaged:
            expected = (document or {}).get("checksums", {}).get("tensors", {})
            changed = sorted(k for k, v in actual["tensors"].items() if k in expected and expected[k] != v)
            named = f" (checksum mismatch: {', '.join(changed)})" if changed else ""
            raise CorruptCheckpointError(
                f"checkpoint {path}: {', '.join(damaged)} fail(s) the zip's CRC32: the file is damaged{named}"
            )
        _say_once(
            "edited",
            path,
            f"lightning-ft: checkpoint {path} was changed after lightning-ft wrote it (its content no longer matches"
            " the checksums recorded at the save): it is loaded as Lightning loads it, edits included."
            + (
                " lightning-ft's own per-process state of that save (RNG states, the samplers' positions) still"
                " applies, so a resume continues from the edited state; it is not the exact continuation of the saved"
                " run"
                if document is not None
                else " Its lightning-ft record is gone or unreadable: RNG states and the samplers' positions are not"
                " restored, so a resume is not exact"
            ),
        )
    if document is None:
        return loaded, ({"callbacks": loaded.pop("callbacks")} if "callbacks" in loaded else {}), {}, True
    typed: dict[str, torch.Tensor] = {}
    for key in document.get("tensors", {}):
        tensor = entries.get(key)
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"checkpoint {path}: lightning-ft's record lacks its tensor {key!r}")
        typed[key] = tensor.clone()  # a view into a shared storage: torch.set_rng_state reads from its start

    def tensor_of(key: str, _: str) -> torch.Tensor:
        if key not in typed:
            raise CorruptCheckpointError(f"checkpoint {path}: lightning-ft's record lacks its tensor {key!r}")
        return typed[key]

    others = document.get("other_rank_states") or []
    saved_rank = rank % (1 + len(others))
    callbacks = loaded.pop("callbacks", None)
    if saved_rank == 0:
        own = json_codec.decode(document.get("rank_state"), tensor_of)
        rank_state = dict(own) if isinstance(own, dict) else {}
        if callbacks is not None:  # a weights-only save has no callbacks
            rank_state["callbacks"] = callbacks
    else:
        own = json_codec.decode(others[saved_rank - 1], tensor_of)
        rank_state = dict(own) if isinstance(own, dict) else {}
    if "loops" in loaded:
        positions = [(int(i), json_codec.decode(s)) for i, s in document.get("samplers", [])]
        loaded["loops"] = with_sampler_states(loaded["loops"], positions)
    metadata = json_codec.decode(document.get("metadata", {}))
    return loaded, rank_state, metadata if isinstance(metadata, dict) else {}, edited


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return dtype


def checkpoint_dict(document: dict[str, Any], entries: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Lightning's checkpoint dict, as the file holds it, built from a save's document and its staged entries (flat
    ``uint8`` views of the staging buffers, by entry name): the tensors of the dict are views of the staged copies,
    never the caller's tensors, and the ``rank_state``'s ``callbacks`` go back to the top level, where Lightning keeps
    them. Adds :data:`RECORD_KEY`: lightning-ft's record, which holds no second copy of anything in Lightning's dict
    (see the module docstring).

    Raises:
        CheckpointError: a tensor is stored in more than one shard (a folder's sharded layout).
    """
    return FileContent(document, entries).checkpoint(stamp=time.time())


_UNKNOWN_CRC = 0xFFFFFFFF
"""The widest crc32: the placeholder of a checksum not known yet, in a record whose pickle must keep its size."""


class FileContent:
    """Lightning's checkpoint dict of one save, built once from its document and staged entries, and its record
    (:meth:`checkpoint`), which may be built twice: first with placeholders where a tensor's crc32 is not known yet
    (a file every rank writes its share of: no rank staged every byte), then with the crc32s the ranks' writes gave,
    in a pickle of the same size (``fixed_width``)."""

    def __init__(self, document: dict[str, Any], entries: Mapping[str, torch.Tensor]) -> None:
        typed: dict[str, torch.Tensor] = {}
        known: dict[int, int] = {}
        unknown: set[int] = set()
        for key, record in document["tensors"].items():
            dtype, shape = _dtype(record["dtype"]), record["global_shape"]
            shards = record["shards"]
            if len(shards) > 1 or any(list(s["offset"]) != [0] * len(shape) for s in shards):
                raise CheckpointError(f"tensor {key!r} is stored in shards; a checkpoint file holds whole tensors only")
            if shards:
                # A storage of the tensor's own bytes, no copy: a staged copy is a view into a larger (page-aligned)
                # buffer, and torch.save writes a tensor's whole storage, so the file would hold the padding, and its
                # layout would depend on where this process's allocator put the buffer (every rank of a file written
                # together must pickle the same storages).
                typed[key] = torch.from_numpy(entries[shards[0]["entry"]].numpy()).view(dtype).reshape(shape)
                if isinstance(shards[0].get("crc32"), int):
                    known[id(typed[key])] = shards[0]["crc32"]
                elif typed[key].numel():
                    unknown.add(id(typed[key]))
            else:
                typed[key] = torch.empty(shape, dtype=dtype)

        def tensor(key: str, _: str) -> torch.Tensor:
            return typed[key]

        # The pickled objects in the state are the bytes this process pickled at the save call, not bytes from storage.
        checkpoint = json_codec.decode_own(document["state"], tensor)
        samplers: list[tuple[int, Any]] = []
        if "loops" in checkpoint:  # Lightning's readers refuse the samplers' states; the record keeps them
            samplers = sampler_positions(checkpoint["loops"])
            checkpoint["loops"] = without_sampler_states(checkpoint["loops"])
        rank_states = document["rank_states"]
        own = rank_states[0] if rank_states else None
        if isinstance(own, dict) and "callbacks" in own:
            checkpoint["callbacks"] = json_codec.decode_own(own["callbacks"], tensor)  # where Lightning keeps them
            own = {k: v for k, v in own.items() if k != "callbacks"}
        # Ranks 1.. (a file written by several processes): their whole rank state, callbacks included (Lightning's
        # dict holds rank 0's only), so every rank resumes its own RNG and per-rank values.
        self._others = list(rank_states[1:])
        self._own = own
        self._record_entries = {key: typed[key] for key in sorted(json_codec.tensor_keys([own, self._others], set()))}
        self._typed = typed
        self._known = known
        self._unknown = unknown
        self._samplers = samplers
        self._document = document
        self._checkpoint = checkpoint

    def checkpoint(
        self, *, stamp: float, crcs: Mapping[int, int] | None = None, fixed_width: bool = False
    ) -> dict[str, Any]:
        """Lightning's dict with :data:`RECORD_KEY` (a new top-level dict each call; the values are shared).
        ``stamp``: the marker's time. ``crcs``: the crc32 of storages by their ``data_ptr()`` (what the ranks' writes
        gave), for the tensors whose crc32 the document does not hold; a tensor still unknown gets the placeholder
        0xFFFFFFFF (never a read of its bytes). ``fixed_width``: the document and the marker are padded (trailing
        spaces, which JSON ignores) to the size they have with every crc32 at its widest, so that the pickle's size
        does not depend on the checksums."""
        known = dict(self._known)
        for tensor in self._typed.values():
            if id(tensor) in self._unknown:
                crc = (crcs or {}).get(tensor.untyped_storage().data_ptr())
                known[id(tensor)] = _UNKNOWN_CRC if crc is None else crc
        checksums = content_checksums({**self._checkpoint, RECORD_KEY: {"entries": self._record_entries}}, known)
        document = self._document
        metadata = document["metadata"]
        body = {
            "lightning_ft_document": FORMAT_VERSION,
            "format_version": document.get("format_version"),
            "metadata": metadata,
            "rank_state": self._own,
            **({"other_rank_states": self._others} if self._others else {}),
            "tensors": {key: document["tensors"][key] for key in self._record_entries},
            "samplers": [[i, json_codec.encode(s)] for i, s in self._samplers],
            "checksums": checksums,
        }
        text = json.dumps(body, allow_nan=False)
        if fixed_width:
            widest = {k: [dtype, shape, _UNKNOWN_CRC] for k, (dtype, shape, _) in checksums["tensors"].items()}
            text = text.ljust(len(json.dumps({**body, "checksums": {**checksums, "tensors": widest}}, allow_nan=False)))
        marker = {
            "lightning_ft_file": FORMAT_VERSION,
            "step": metadata.get("step"),
            "full_state": metadata.get("full_state") if isinstance(metadata.get("full_state"), bool) else None,
            "run_id": metadata.get("run_id") if isinstance(metadata.get("run_id"), str) else None,
            "world_size": metadata.get("world_size"),
            "time": stamp,
            "document_crc32": zlib.crc32(text.encode()),
        }
        marker_text = json.dumps(marker)  # starts with MARKER_PREFIX: the first key is "lightning_ft_file"
        if fixed_width:
            marker_text = marker_text.ljust(len(json.dumps({**marker, "document_crc32": _UNKNOWN_CRC})))
        return {
            **self._checkpoint,
            RECORD_KEY: {"marker": marker_text, "document": text, "entries": self._record_entries},
        }


def _load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of a checkpoint file, memory-mapped. A file that names no global beyond
    torch's own (the common case: torch's scan of the pickle executes nothing) is loaded without importing Lightning,
    so ``lightning-ft inspect`` stays quick; any other goes through the project's allowed globals."""
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # noqa: BLE001 - a zip that torch's reader cannot open: damaged or truncated
        raise CorruptCheckpointError(f"{path} is not a readable torch.save file ({type(e).__name__}: {e})") from e
    if needed:
        from lightning_ft.checkpoint.safe_load import load_torch_file

        return load_torch_file(path, mmap=True)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch's reader on a damaged file
        raise CorruptCheckpointError(f"{path} is not a readable torch.save file ({type(e).__name__}: {e})") from e


class FileReader:
    """Reads the entries of one checkpoint file back, through ``torch.load(weights_only=True)`` with the allowed
    globals only (memory-mapped: an entry is read when it is asked for). Obtained from :meth:`FileStorage.reader`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        loaded = _load(self.path)
        record = loaded.get(RECORD_KEY) if isinstance(loaded, dict) else None
        entries = record.get("entries") if isinstance(record, dict) else None
        if not isinstance(entries, dict):
            raise CorruptCheckpointError(f"checkpoint {path}: no lightning-ft entries in the file")
        self._entries: dict[str, torch.Tensor] = entries

    def files(self, rank: int, name: str) -> list[str]:
        """The file holding entry ``name`` (the checkpoint itself), or ``[]`` when it has no such entry."""
        return [self.path.name] if rank == 0 and name in self._entries else []

    def unsafe_entries(self) -> list[str]:
        """Always ``[]``: the file was read with the restricted unpickler, which refuses what is not allowed."""
        return []

    def read(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Copy entry ``name``'s bytes into the CPU ``uint8`` tensor ``out``.

        Raises ``KeyError`` if the file lacks the entry, ``EOFError`` if its size is not ``out``'s."""
        if rank != 0 or name not in self._entries:
            raise KeyError(f"{rank}/{name}")
        data = self._entries[name].detach().contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != out.numel():
            raise EOFError(f"entry {name} holds {data.numel()} bytes, the index says {out.numel()}")
        out.copy_(data)


class FileStorage:
    """The storage seam of ``checkpoint_format="file"``: one ``torch.save`` file per checkpoint, written by one process
    (``torch.save``) or by every rank of a data-parallel world together
    (:func:`~lightning_ft.checkpoint.parallel_file.save`: each rank writes about 1/N of the tensor bytes).

    Example::

        storage = FileStorage()
        storage.write(staging_folder, entries, group=None, document=document)  # staging_folder/checkpoint.ckpt
        FileStorage().reader(Path("epoch=0-step=10.ckpt")).read(0, "t0", out)
    """

    writes_files = True
    """Tells the checkpointer that a save is one file, committed by a rename (not a folder with a marker)."""

    def __init__(self) -> None:
        self.last_result: Any = None
        """What this rank did in its newest parallel write (a :class:`~lightning_ft.checkpoint.parallel_file.SaveResult`:
        bytes written, time per phase); ``None`` before one (and for a one-process write)."""

    def write(
        self,
        path: Path,
        entries: Mapping[str, torch.Tensor],
        *,
        group: dist.ProcessGroup | None,
        document: dict[str, Any] | None = None,
        shares: Mapping[str, list[tuple[int, int, int]]] | None = None,
    ) -> None:
        """Write the checkpoint file ``path/``:data:`STAGED_NAME` from ``entries`` (flat ``uint8`` staged copies) and
        the save's ``document``, and fsync it and ``path``.

        Collective over ``group`` when it has more than one rank: every rank passes the same ``document`` (every rank's
        state; the shared tensors' entries its own copies of the replicated state) and the same ``path`` (a folder
        every rank sees), and the ranks write the one file together, each about 1/N of the tensor bytes; it returns
        once every rank's bytes are durable. ``shares`` (the capture's
        :attr:`~lightning_ft.checkpoint.staging.Capture.shares`, by entry name): who writes which bytes of those
        entries, of which this rank holds only its own (the rest is never read). Otherwise one process writes it with
        ``torch.save``.
        """
        if document is None:
            raise CheckpointError("a checkpoint file is written with its metadata document")
        target = Path(path) / STAGED_NAME
        content = FileContent(document, entries)
        stamp = time.time()
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            from lightning_ft.checkpoint import parallel_file
            from lightning_ft.checkpoint.snapshot_storage import fsync_dir

            if shares:
                # Each rank holds only the bytes it writes: the crc32s in the record are known once every rank wrote
                # its pieces; rank 0 pickles the record again with them, at the same size.
                self.last_result = parallel_file.save(
                    content.checkpoint(stamp=stamp, fixed_width=True),
                    target,
                    group=group,
                    shares={entries[name].data_ptr(): ranges for name, ranges in shares.items() if name in entries},
                    finalize=lambda crcs: content.checkpoint(stamp=stamp, crcs=crcs, fixed_width=True),
                )
            else:
                self.last_result = parallel_file.save(content.checkpoint(stamp=stamp), target, group=group)
            if dist.get_rank(group) == 0:
                fsync_dir(Path(path))  # the file's name in the staging folder (parallel_file leaves it to the caller)
            return
        # Straight into the file: torch.save streams each tensor's bytes from the staged copy. (Lightning's
        # TorchCheckpointIO serializes the whole checkpoint into memory first, then writes it: a second and third copy
        # of the state in host memory, beside the staged one, for the length of the write.)
        with open(target, "wb") as f:
            torch.save(content.checkpoint(stamp=stamp), f)
            f.flush()
            os.fsync(f.fileno())
        from lightning_ft.checkpoint.snapshot_storage import fsync_dir

        fsync_dir(Path(path))

    def reader(self, path: Path) -> FileReader:
        return FileReader(path)
