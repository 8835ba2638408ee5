"""Reading one rank's ``rank_state`` of a committed checkpoint without loading the rest of it.

The callback states Lightning saves live in the rank state. ``ckpt_path="best"`` in a fresh process needs only the
``ModelCheckpoint`` state of the newest checkpoint (its best and top-k paths and scores), so :func:`read_rank_state`
reads the metadata file and only the shards the rank state references.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.commit import read_document
from lightning_ft.checkpoint.shard_reader import ShardReader
from lightning_ft.checkpoint.single_file import file_version, load_file
from lightning_ft.checkpoint.storage.object_store import ObjectStore, is_remote
from lightning_ft.checkpoint.storage.registry import storage_for_path

__all__ = ["read_rank_state"]


def read_rank_state(path: str | os.PathLike, rank: int = 0) -> Any:
    """The ``rank_state`` rank ``rank`` (modulo the saved world size) saved in committed checkpoint ``path``.

    Not collective. Tensors come back as CPU tensors, checksums checked.

    Raises:
        CheckpointError: as :func:`~lightning_ft.checkpoint.load_checkpoint`.
    """
    path = Path(path)
    if not is_remote(path) and path.is_file() and file_version(path) not in (None, 1):
        # Lightning's own file: the callbacks are Lightning's (as Lightning loads them), the rest is the record's.
        return load_file(path, rank=rank)[1]
    document = ObjectStore().read_document(path) if is_remote(path) else read_document(path)
    reader = ShardReader(path, document, storage_for_path(path), verify_checksums=True)
    rank_states = document["rank_states"]
    tensors = document["tensors"]
    return json_codec.decode(
        rank_states[rank % len(rank_states)],
        lambda key, _: reader.assemble(key, [0] * len(tensors[key]["global_shape"]), tensors[key]["global_shape"]),
    )
