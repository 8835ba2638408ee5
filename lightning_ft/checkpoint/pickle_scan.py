"""Finding string constants in a ``torch.save`` file's pickle without executing it: how a lightning-ft checkpoint file
is recognized by its marker (:mod:`~lightning_ft.checkpoint.single_file`), even where its zip directory is lost."""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

from lightning_ft.checkpoint.file_checks import pickle_record, stored_bytes

__all__ = ["scan_pickle"]


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


def scan_pickle(path: Path, prefixes: tuple[str, ...]) -> tuple[zipfile.ZipInfo | None, bytes, dict[str, str]] | None:
    """The pickle record of the zip file ``path`` (``None`` for a zip whose directory is lost), its bytes and the
    strings of ``prefixes`` in it; ``None`` when ``path`` is no zip file with a pickle."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        try:
            with zipfile.ZipFile(path) as archive:
                info = pickle_record(archive)
        except zipfile.BadZipFile:
            data = _first_record_bytes(path)  # its directory lost: a truncated copy, a damaged disk
            return None if data is None else (None, data, _strings(data, prefixes))
        if info is None:
            return None
        data = stored_bytes(path, info)
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    return info, data, _strings(data, prefixes)


_MAX_PICKLE_SCAN = 256 * 1024 * 1024


def _first_record_bytes(path: Path) -> bytes | None:
    """The bytes of the first record of a zip file whose directory cannot be read: ``torch.save`` writes its pickle
    first, from the end of its local header to its size there or, where the size follows the bytes (a data descriptor),
    to that descriptor's signature. ``None`` when the file does not start with a local header of a ``data.pkl``."""
    with open(path, "rb") as f:
        header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return None
        name_len = int.from_bytes(header[26:28], "little")
        extra_len = int.from_bytes(header[28:30], "little")
        name = f.read(name_len)
        if not name.endswith(b"/data.pkl"):
            return None
        f.seek(30 + name_len + extra_len)
        size = int.from_bytes(header[18:22], "little")
        data = f.read(size if 0 < size < 0xFFFFFFFF else _MAX_PICKLE_SCAN)
    end = data.find(b"PK\x07\x08")
    return data if end < 0 else data[:end]
