"""What ``trainer.fit(ckpt_path=...)`` raises for each bad checkpoint is exactly what docs/checkpointing.md names.

The table in the docs is read by this test, so the two cannot drift apart: every row has a case here that builds the
situation for real and drives it through ``fit``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import ElasticFT3D
from lightning_ft import checkpoint as lft_checkpoint
from lightning_ft.checkpoint.in_progress import discard
from lightning_ft.checkpoint.internal import COMMIT_MARKER, FORMATS, METADATA_FILE
from tests.checkpoint.support import flip_a_byte_of, plant_pickled_entry
from tests.helpers import REPO_ROOT
from tests.strategy.models import TinyRegressor, make_trainer

DOC = Path(REPO_ROOT) / "docs" / "checkpointing.md"


def documented_errors() -> dict[str, str]:
    """situation -> error class name, from the table under "Errors you may see"."""
    section = DOC.read_text().split("## Errors you may see", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| `(\w+)`.*\|$", section, flags=re.M)
    return {situation: error for situation, error in rows if situation != "situation"}


class ShardedRegressor(TinyRegressor):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


class Unpickled:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


# The folder formats: each row damages a folder's own files (a file's refusals: tests/checkpoint/test_single_file.py).
@pytest.fixture(scope="module", params=[name for name in FORMATS if name not in ("file", "auto")])
def trained(request, tmp_path_factory):
    """A committed checkpoint at step 2 (and ``last`` pointing at it), written by a real Trainer in each format."""
    root = tmp_path_factory.mktemp(f"trained-{request.param}")
    env_before = dict(os.environ)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_last=True)
    strategy = ElasticFT3D(checkpoint_format=request.param)
    make_trainer(root, strategy=strategy, callbacks=[ckpt], max_steps=2).fit(TinyRegressor())
    if dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(env_before):
        del os.environ[key]
    return root / "ckpt"


def _rewrite_metadata(path: Path, change) -> None:
    document = json.loads((path / METADATA_FILE).read_text())
    change(document)
    data = json.dumps(document).encode()
    (path / METADATA_FILE).write_bytes(data)
    marker = json.loads((path / COMMIT_MARKER).read_text())
    marker["metadata_crc32"] = zlib.crc32(data)
    (path / COMMIT_MARKER).write_text(json.dumps(marker))


def _missing(ckpt: Path) -> Path:
    return ckpt / "epoch=0-step=9.ckpt"


def _uncommitted(ckpt: Path) -> Path:
    path = ckpt / "epoch=0-step=2.ckpt"
    (path / COMMIT_MARKER).unlink()
    return path


def _last_to_uncommitted(ckpt: Path) -> Path:
    # Lightning's save_last="link" link to a save that never finished (a crash mid-write), nothing else committed.
    target = _uncommitted(ckpt)
    last = ckpt / "last.ckpt"
    discard(last)  # the checkpoint of its own that save_last=True wrote
    os.symlink(target.name, last)
    return last


def _foreign_folder(ckpt: Path) -> Path:
    path = ckpt / "someone-elses.ckpt"
    path.mkdir()
    (path / "README").write_text("not a checkpoint")
    return path


def _unknown_format(ckpt: Path) -> Path:
    path = ckpt / "epoch=0-step=2.ckpt"
    _rewrite_metadata(path, lambda document: document.update(format_version=99))
    return path


def _bad_checksum(ckpt: Path) -> Path:
    path = ckpt / "epoch=0-step=2.ckpt"
    flip_a_byte_of(path, lft_checkpoint.load_checkpoint(path).state["state_dict"]["net.0.weight"])
    return path


def _bad_metadata(ckpt: Path) -> Path:
    path = ckpt / "epoch=0-step=2.ckpt"
    (path / METADATA_FILE).write_bytes(b"{ not json")
    return path


def _uncovered(ckpt: Path) -> Path:
    path = ckpt / "epoch=0-step=2.ckpt"

    def grow_first_tensor(document: dict) -> None:
        record = next(iter(document["tensors"].values()))
        record["global_shape"] = [2 * n for n in record["global_shape"]]  # the stored shards now cover a quarter

    _rewrite_metadata(path, grow_first_tensor)
    return path


def _pickled_entry(ckpt: Path) -> Path:
    path = ckpt / "epoch=0-step=2.ckpt"
    if not (path / ".snapshot_metadata").exists():
        pytest.skip("a DCP folder holds no entry lightning-ft would unpickle (test_load.py plants one in .metadata)")
    plant_pickled_entry(path, Unpickled(str(ckpt / "pwned")))
    return path


def _stored_object_needing_a_global(ckpt: Path) -> Path:
    # What a tampered metadata document would hold: a stored object whose unpickling calls open(..., "w").
    path = ckpt / "epoch=0-step=2.ckpt"
    payload = io.BytesIO()
    torch.save(Unpickled(str(ckpt / "pwned")), payload)
    stored = {"__lft__": "pickle", "type": "builtins.object", "data": base64.b64encode(payload.getvalue()).decode()}
    _rewrite_metadata(path, lambda document: document["state"].update(planted=stored))
    return path


def _unsafe_file(ckpt: Path) -> Path:
    path = ckpt / "evil.ckpt"
    path.write_bytes(pickle.dumps({"state_dict": Unpickled(str(ckpt / "pwned"))}))
    return path


def _unreadable_file(ckpt: Path) -> Path:
    path = ckpt / "damaged.ckpt"
    torch.save({"state_dict": TinyRegressor().state_dict()}, path)
    path.write_bytes(path.read_bytes()[:100])
    return path


def _bare_ellipsis_allowed(ckpt: Path) -> Path:
    path = ckpt / "plain.ckpt"
    torch.save({"state_dict": TinyRegressor().state_dict()}, path)
    torch.serialization.add_safe_globals([Ellipsis])  # what printing `builtins.Ellipsis` led users to do
    return path


class Fragile:
    """An allowed class whose reconstruction fails in this process (it needs what is not here)."""

    def __setstate__(self, state) -> None:
        raise RuntimeError("Fragile needs a device this process does not have")


def _intact_but_not_deserializable(ckpt: Path) -> Path:
    path = ckpt / "fragile.ckpt"
    fragile = Fragile()
    fragile.value = 1
    torch.save({"state_dict": TinyRegressor().state_dict(), "fragile": fragile}, path)
    torch.serialization.add_safe_globals([Fragile])
    return path


@pytest.fixture(autouse=True)
def _restore_safe_globals():
    before = list(torch.serialization.get_safe_globals())
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def _file_for_dtensor_model(ckpt: Path) -> Path:
    path = ckpt / "plain.ckpt"
    torch.save({"state_dict": TinyRegressor(dim=4).state_dict()}, path)  # the model takes 8 inputs
    return path


CASES = {
    "nothing exists at the path": _missing,
    "a lightning-ft checkpoint without its commit marker (its save never finished)": _uncommitted,
    "a `last` link to an uncommitted checkpoint, and no committed checkpoint beside it": _last_to_uncommitted,
    "a folder that lightning-ft did not write": _foreign_folder,
    "a format version this release does not know": _unknown_format,
    "a shard file missing, truncated, or failing its checksum (names the tensor key and the file)": _bad_checksum,
    "the metadata file unreadable or not matching the marker": _bad_metadata,
    "stored shards that do not cover a tensor of the index (a checkpoint of another writer)": _uncovered,
    "a pickled payload (a torchsnapshot object entry, a `torch.save`d entry)": _pickled_entry,
    "a stored object (see [Your own classes](#your-own-classes-in-a-checkpoint)) that needs a global not allowed in the"
    " loading process": _stored_object_needing_a_global,
    "a Lightning `.ckpt` file that needs more than `torch.load(weights_only=True)`": _unsafe_file,
    "a Lightning `.ckpt` file that is not a readable `torch.save` file": _unreadable_file,
    "a Lightning `.ckpt` file whose tensors do not fit a parallelized (DTensor) model": _file_for_dtensor_model,
    "`torch.serialization.add_safe_globals` given an object torch cannot name (`Ellipsis`)": _bare_ellipsis_allowed,
    "an intact `.ckpt` file that cannot be deserialized in this process": _intact_but_not_deserializable,
}


def test_every_documented_situation_has_a_case():
    assert set(documented_errors()) == set(CASES)


@pytest.mark.parametrize("situation", list(CASES))
def test_fit_with_a_bad_ckpt_path_raises_the_documented_error(trained, tmp_path, situation):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt, symlinks=True)
    bad = CASES[situation](ckpt)
    model = ShardedRegressor() if "DTensor" in situation else TinyRegressor()
    trainer = make_trainer(tmp_path, callbacks=[ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2)], max_steps=4)
    expected = getattr(lft_checkpoint, documented_errors()[situation])
    with pytest.raises(expected) as raised:
        trainer.fit(model, ckpt_path=str(bad))
    assert type(raised.value) is expected, f"{type(raised.value).__name__}: {raised.value}"
    assert bad.name in str(raised.value)
    assert trainer.global_step == 0
    assert not (ckpt / "pwned").exists()
