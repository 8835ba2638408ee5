"""A lightning-ft checkpoint as one file, for a world of one process: the file Lightning itself writes, plus our record.

``ElasticFT3D(checkpoint_format="file")`` writes, at the path Lightning asks for, the ``torch.save`` zip file of
Lightning's checkpoint dict, so ``torch.load(path)``, Lightning's ``pl_load``, ``LightningModule.load_from_checkpoint``
and ``os.path.isfile`` work on it. One top-level key is added, :data:`RECORD_KEY` (``"lightning_ft"``), holding only
strings and tensors:

- ``"marker"``: a JSON string starting with :data:`MARKER_PREFIX`: format version, step, ``full_state``, run id, time
  and the crc32 of the document string. It plays the commit marker's part: a file holding it at a checkpoint path is
  committed (it is only ever put there by a rename, after it was durable), and it is lightning-ft's proof that it wrote
  the file. :func:`read_marker` finds it without executing the pickle: it reads the zip's ``data.pkl`` record with
  :mod:`zipfile` and walks its opcodes with :func:`pickletools.genops`, looking only at string constants.
- ``"document"``: a JSON string, the same metadata document a checkpoint folder keeps in ``lightning_ft_metadata.json``
  (run metadata, the non-tensor state as JSON, every rank's ``rank_state``: RNG states, callback states; the tensor
  index with a crc32 per entry), so a file loads through the very path a folder loads through.
- ``"entries"``: the staged tensors by entry name; they share their storage with the tensors of Lightning's dict, so
  ``torch.save`` writes every tensor's bytes once.

``torch.load`` checks no checksum, so a load checks three: the zip's own CRC32 of ``data.pkl`` (the pickled non-tensor
state Lightning's readers see), the document's crc32 in the marker, and every entry's crc32 in the index.
:class:`FileStorage` is the storage seam for the format: it writes the file into a save's staging folder (the commit,
a rename onto the checkpoint path, is :mod:`~lightning_ft.checkpoint.file_commit`'s) and reads entries back through
``torch.load(weights_only=True)`` with the allowed globals only (:func:`~lightning_ft.checkpoint.safe_load.load_torch_file`).
"""

from __future__ import annotations

import json
import os
import pickletools
import time
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

__all__ = [
    "MARKER_PREFIX",
    "RECORD_KEY",
    "STAGED_NAME",
    "FileReader",
    "FileStorage",
    "is_checkpoint_file",
    "read_file_document",
    "read_marker",
    "without_sampler_states",
]

FORMAT_VERSION = 1
"""The single-file format this release writes and reads (the folder's metadata document inside has its own)."""
RECORD_KEY = "lightning_ft"
"""The top-level key of Lightning's checkpoint dict that holds lightning-ft's record."""
MARKER_PREFIX = '{"lightning_ft_file": '
"""How the marker string begins; what :func:`read_marker` looks for among the pickle's string constants."""
_DOCUMENT_PREFIX = '{"lightning_ft_document": '
STAGED_NAME = "checkpoint.ckpt"
"""The file's name inside the staging folder it is written in before the rename onto the checkpoint path."""


def _pickle_record(archive: zipfile.ZipFile) -> zipfile.ZipInfo | None:
    for info in archive.infolist():
        parts = info.filename.split("/")
        if len(parts) == 2 and parts[1] == "data.pkl":
            return info
    return None


def _stored_bytes(path: Path, info: zipfile.ZipInfo) -> bytes:
    """A stored (uncompressed) zip record's bytes as they are on disk, without zipfile's CRC check (done by callers
    that need it, so that a damaged file of ours is still recognized as ours)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise zipfile.BadZipFile(f"{info.filename} is compressed; torch.save stores records uncompressed")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"bad local header of {info.filename}")
        name_len = int.from_bytes(header[26:28], "little")
        extra_len = int.from_bytes(header[28:30], "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        data = f.read(info.compress_size)
    if len(data) != info.compress_size:
        raise zipfile.BadZipFile(f"{info.filename} is truncated")
    return data


def _strings(data: bytes, prefixes: tuple[str, ...]) -> dict[str, str]:
    """The first string constant of the pickle ``data`` starting with each of ``prefixes``; never executes it.

    The opcodes are walked with :func:`pickletools.genops`; where the pickle is damaged (a flipped byte that breaks a
    string's UTF-8, say) the rest is found as a ``BINUNICODE`` opcode (``X``, a 4-byte length, the UTF-8 bytes) by its
    bytes, so a damaged file of ours is still recognized as ours (and then refused by its checksums)."""
    found: dict[str, str] = {}
    # A string constant is stored as its UTF-8 bytes: a pickle without them (every other .ckpt file) is not walked.
    prefixes = tuple(prefix for prefix in prefixes if prefix.encode() in data)
    if not prefixes:
        return found
    try:
        for _, arg, _ in pickletools.genops(data):
            if isinstance(arg, str):
                for prefix in prefixes:
                    if prefix not in found and arg.startswith(prefix):
                        found[prefix] = arg
                if len(found) == len(prefixes):
                    return found
    except Exception:  # noqa: BLE001 - a damaged pickle: look for the rest by their bytes
        pass
    for prefix in prefixes:
        at = data.find(prefix.encode())
        if prefix in found or at < 2:
            continue
        if at >= 5 and data[at - 5] == ord("X"):  # BINUNICODE: 4-byte length (torch.save's protocol 2)
            size = int.from_bytes(data[at - 4 : at], "little")
        elif data[at - 2] == 0x8C:  # SHORT_BINUNICODE: 1-byte length (protocol 4)
            size = data[at - 1]
        else:
            continue
        try:
            found[prefix] = data[at : at + size].decode()
        except UnicodeDecodeError:
            continue
    return found


def _scan(path: Path, prefixes: tuple[str, ...]) -> tuple[zipfile.ZipInfo, bytes, dict[str, str]] | None:
    try:
        if path.is_symlink() or not path.is_file():
            return None
        with zipfile.ZipFile(path) as archive:
            info = _pickle_record(archive)
        if info is None:
            return None
        data = _stored_bytes(path, info)
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    return info, data, _strings(data, prefixes)


def read_marker(path: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of the lightning-ft checkpoint file ``path``, or ``None`` when ``path`` is not one (not a regular
    file, a link, not a zip, no marker: a Lightning ``.ckpt`` of another strategy, say). Executes nothing."""
    scanned = _scan(Path(path), (MARKER_PREFIX,))
    if scanned is None or MARKER_PREFIX not in scanned[2]:
        return None
    try:
        marker = json.loads(scanned[2][MARKER_PREFIX])
    except ValueError:
        return {}
    return marker if isinstance(marker, dict) else {}


def is_checkpoint_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint file lightning-ft wrote (a regular file holding our marker; see
    :func:`read_marker`). Such a file at a checkpoint path is committed."""
    return read_marker(path) is not None


def read_file_document(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check the metadata document of the checkpoint file ``path`` (executes nothing).

    Raises:
        UncommittedCheckpointError: ``path`` is not a lightning-ft checkpoint file.
        CorruptCheckpointError: the pickled part fails the zip's CRC32, or the document is missing, fails its crc32 or
            is not valid JSON.
        FormatVersionError: a format version this release does not read.
    """
    path = Path(path)
    scanned = _scan(path, (MARKER_PREFIX, _DOCUMENT_PREFIX))
    if scanned is None or MARKER_PREFIX not in scanned[2]:
        raise UncommittedCheckpointError(f"checkpoint {path} is not a lightning-ft checkpoint file")
    info, data, found = scanned
    if zlib.crc32(data) != info.CRC:
        raise CorruptCheckpointError(f"checkpoint {path}: its pickled state ({info.filename}) fails the zip's CRC32")
    try:
        marker = json.loads(found[MARKER_PREFIX])
    except ValueError as e:
        raise CorruptCheckpointError(f"checkpoint {path}: its marker is not valid JSON") from e
    version = marker.get("lightning_ft_file")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"checkpoint {path} has file format version {version!r}; this lightning-ft reads version {FORMAT_VERSION}"
        )
    text = found.get(_DOCUMENT_PREFIX)
    if text is None:
        raise CorruptCheckpointError(f"checkpoint {path}: its metadata document is missing")
    if zlib.crc32(text.encode()) != marker.get("document_crc32"):
        raise CorruptCheckpointError(f"checkpoint {path}: its metadata document does not match the marker's checksum")
    try:
        document = json.loads(text)
    except ValueError as e:
        raise CorruptCheckpointError(f"checkpoint {path}: its metadata document is not valid JSON ({e})") from e
    document.pop("lightning_ft_document", None)
    return document


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return dtype


SAMPLER_STATE_KEYS = frozenset({"epoch", "consumed", "seed", "shuffle", "drop_last", "dataset_len"})
"""The keys of a :class:`~lightning_ft.elastic.ResumableSampler` state: how its entry among the training loaders'
states is told from a stateful loader of the user's own (litData's, say)."""


def without_sampler_states(loops: Any) -> Any:
    """Lightning's loop state without the resumable samplers' positions among the training loaders' states.

    lightning-ft makes the training DataLoaders it swaps a :class:`~lightning_ft.elastic.ResumableSampler` into
    stateful, so Lightning saves their positions with its loop state; under another strategy those loaders are not
    stateful and Lightning refuses a mid-epoch checkpoint with more loader states than stateful loaders ("The
    CombinedLoader has 0 stateful loaders, but found 1 states"). The states of loaders that are stateful by themselves
    are kept, in order; lightning-ft reads its own from the checkpoint's metadata document, not from here.
    """
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    state_dict = fit_loop.get("state_dict") if isinstance(fit_loop, dict) else None
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("combined_loader"), list):
        return loops
    kept = [s for s in state_dict["combined_loader"] if not (isinstance(s, dict) and set(s) == SAMPLER_STATE_KEYS)]
    state_dict = {k: v for k, v in state_dict.items() if k != "combined_loader"} | (
        {"combined_loader": kept} if kept else {}
    )
    return {**loops, "fit_loop": {**fit_loop, "state_dict": state_dict}}


def checkpoint_dict(document: dict[str, Any], entries: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Lightning's checkpoint dict, as the file holds it, built from a save's document and its staged entries (flat
    ``uint8`` views of the staging buffers, by entry name): the tensors of the dict are views of the staged copies,
    never the caller's tensors, and the ``rank_state``'s ``callbacks`` go back to the top level, where Lightning keeps
    them. Adds :data:`RECORD_KEY`.

    Raises:
        CheckpointError: a tensor is stored in more than one shard (a world of more than one process).
    """
    typed: dict[str, torch.Tensor] = {}
    for key, record in document["tensors"].items():
        dtype, shape = _dtype(record["dtype"]), record["global_shape"]
        shards = record["shards"]
        if len(shards) > 1 or any(list(s["offset"]) != [0] * len(shape) for s in shards):
            raise CheckpointError(f"tensor {key!r} is stored in shards; a checkpoint file holds whole tensors only")
        if shards:
            typed[key] = entries[shards[0]["entry"]].view(dtype).reshape(shape)
        else:
            typed[key] = torch.empty(shape, dtype=dtype)

    def tensor(key: str, _: str) -> torch.Tensor:
        return typed[key]

    # The pickled objects in the state are the bytes this process pickled at the save call, not bytes from storage.
    checkpoint = json_codec.decode_own(document["state"], tensor)
    if "loops" in checkpoint:  # for Lightning's own readers; lightning-ft resumes from the document
        checkpoint["loops"] = without_sampler_states(checkpoint["loops"])
    rank_states = document["rank_states"]
    rank_state = json_codec.decode_own(rank_states[0], tensor) if rank_states else None
    if isinstance(rank_state, dict) and "callbacks" in rank_state:
        checkpoint["callbacks"] = rank_state["callbacks"]
    shard_entries = {
        shard["entry"]: typed[key] for key, record in document["tensors"].items() for shard in record["shards"]
    }
    metadata = document["metadata"]
    text = json.dumps({"lightning_ft_document": FORMAT_VERSION, **document}, allow_nan=False)
    marker = {
        "lightning_ft_file": FORMAT_VERSION,
        "step": metadata.get("step"),
        "full_state": metadata.get("full_state") if isinstance(metadata.get("full_state"), bool) else None,
        "run_id": metadata.get("run_id") if isinstance(metadata.get("run_id"), str) else None,
        "world_size": metadata.get("world_size"),
        "time": time.time(),
        "document_crc32": zlib.crc32(text.encode()),
    }
    checkpoint[RECORD_KEY] = {
        "marker": json.dumps(marker),  # starts with MARKER_PREFIX: the first key is "lightning_ft_file"
        "document": text,
        "entries": shard_entries,
    }
    return checkpoint


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
    """The storage seam of ``checkpoint_format="file"``: one ``torch.save`` file per checkpoint, world size 1.

    Example::

        storage = FileStorage()
        storage.write(staging_folder, entries, group=None, document=document)  # staging_folder/checkpoint.ckpt
        FileStorage().reader(Path("epoch=0-step=10.ckpt")).read(0, "t0", out)
    """

    writes_files = True
    """Tells the checkpointer that a save is one file, committed by a rename (not a folder with a marker)."""

    def write(
        self,
        path: Path,
        entries: Mapping[str, torch.Tensor],
        *,
        group: dist.ProcessGroup | None,
        document: dict[str, Any] | None = None,
    ) -> None:
        """Write the checkpoint file ``path/``:data:`STAGED_NAME` from ``entries`` (flat ``uint8`` staged copies) and
        the save's ``document``, and fsync it and ``path``. Not collective (one process)."""
        if document is None:
            raise CheckpointError("a checkpoint file is written with its metadata document")
        target = Path(path) / STAGED_NAME
        checkpoint = checkpoint_dict(document, entries)
        # Straight into the file: torch.save streams each tensor's bytes from the staged copy. (Lightning's
        # TorchCheckpointIO serializes the whole checkpoint into memory first, then writes it: a second and third copy
        # of the state in host memory, beside the staged one, for the length of the write.)
        with open(target, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        from lightning_ft.checkpoint.snapshot_storage import fsync_dir

        fsync_dir(Path(path))

    def reader(self, path: Path) -> FileReader:
        return FileReader(path)
