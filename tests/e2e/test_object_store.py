"""Two ranks under real torchrun save to, commit in and resume from an object-store dirpath (a shared fake bucket
without rename, copy or link)."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch

from lightning_ft.checkpoint import list_committed, load_checkpoint
from lightning_ft.events import read_events
from tests.e2e._torchrun import SCRIPT as _TRAIN_SCRIPT
from tests.e2e._torchrun import assert_ok, torchrun
from tests.e2e.object_store_script import PROTOCOL, SharedBucket

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # two 2-rank torchrun runs: the extended tier

SCRIPT = _TRAIN_SCRIPT.with_name("object_store_script.py")


def test_two_ranks_commit_in_a_bucket_and_resume_from_the_newest_marker(tmp_path, monkeypatch):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    common = ["--root", str(tmp_path / "run"), "--bucket", str(bucket)]
    assert_ok(torchrun(*common, "--max-steps", "4", "--out", str(tmp_path / "first"), nproc=2, script=SCRIPT))
    assert_ok(torchrun(*common, "--max-steps", "8", "--out", str(tmp_path / "second"), nproc=2, script=SCRIPT))

    monkeypatch.setenv("LFT_TEST_BUCKET", str(bucket))
    fsspec.register_implementation(PROTOCOL, SharedBucket, clobber=True)
    committed = list_committed(f"{PROTOCOL}://ckpt")
    assert [c.step for c in committed] == [6, 8]  # save_top_k=2: the worse ones were deleted
    events = read_events(tmp_path / "run")
    assert [e["step"] for e in events if e["event"] == "resumed"] == [4]
    final = torch.load(tmp_path / "second" / "final.pt", weights_only=True)
    loaded = load_checkpoint(committed[-1].path)
    for name, tensor in final["weights"].items():
        assert torch.equal(loaded.state["state_dict"][name], tensor), name
    assert sorted(os.listdir(bucket / "ckpt")) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    # Both ranks wrote their own data object into each generation.
    assert {p.name for p in (bucket / "ckpt" / "epoch=0-step=8.ckpt").glob("lft-*/data/*")} == {
        "0",
        "0.json",
        "1",
        "1.json",
    }
