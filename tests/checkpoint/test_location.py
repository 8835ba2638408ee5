"""A checkpoint path is classified once, where a load starts: what it is and what it resolved to."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_ft.checkpoint import CheckpointNotFoundError, UncommittedCheckpointError, load_checkpoint
from lightning_ft.checkpoint import location as location_module
from lightning_ft.checkpoint.location import is_last_path, listed, locate
from tests.checkpoint.support import save, uncommitted


def test_a_committed_folder_is_ours_and_read_as_it_is(tmp_path):
    path = save(tmp_path / "step=3", 3)
    found = locate(path)
    assert (found.kind, found.path, found.requested, found.remote, found.note) == (
        "lightning_ft",
        path,
        path,
        False,
        None,
    )
    assert found.ours


def test_a_last_link_resolves_to_its_committed_target(tmp_path):
    target = save(tmp_path / "step=3", 3)
    link = tmp_path / "last.ckpt"
    os.symlink(target.name, link)
    found = locate(link)
    assert found.requested == link and found.path == target.resolve() and found.ours and found.note is None


def test_a_last_link_to_a_save_that_never_committed_resolves_to_the_newest_committed_beside_it_and_says_so(tmp_path):
    older = save(tmp_path / "step=3", 3)
    link = tmp_path / "last.ckpt"
    os.symlink(uncommitted(tmp_path / "step=6", 6).name, link)
    found = locate(link)
    assert found.path == older and found.ours
    assert found.note and str(older) in found.note


def test_a_last_link_with_nothing_committed_beside_it_is_refused(tmp_path):
    link = tmp_path / "last.ckpt"
    os.symlink(uncommitted(tmp_path / "step=6", 6).name, link)
    with pytest.raises(UncommittedCheckpointError, match="not committed"):
        locate(link)


def test_an_uncommitted_folder_of_ours_is_refused_with_the_newest_committed_named(tmp_path):
    committed = save(tmp_path / "step=3", 3)
    with pytest.raises(UncommittedCheckpointError, match="without its commit marker") as info:
        locate(uncommitted(tmp_path / "step=6", 6))
    assert str(committed) in str(info.value)


def test_a_missing_path_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        locate(tmp_path / "nothing.ckpt")
    with pytest.raises(CheckpointNotFoundError):
        locate(tmp_path / "nothing.ckpt")


def test_another_strategys_file_and_folder_are_told_apart(tmp_path):
    file = tmp_path / "epoch=0-step=4.ckpt"
    torch.save({"state_dict": {}}, file)
    assert locate(file).kind == "lightning_file" and not locate(file).ours
    dcp = tmp_path / "dcp.ckpt"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    assert locate(dcp).kind == "dcp_folder"
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(UncommittedCheckpointError, match="neither a lightning-ft checkpoint nor a distributed"):
        locate(plain)


def test_a_listed_candidate_is_located_without_looking_at_it_again(tmp_path, monkeypatch):
    path = save(tmp_path / "step=3", 3)
    monkeypatch.setattr(location_module, "is_lightning_ft_checkpoint", lambda p: pytest.fail("looked again"))
    monkeypatch.setattr(location_module, "is_committed", lambda p: pytest.fail("looked again"))
    assert listed(path, ours=True).ours


def test_load_checkpoint_reads_a_location_without_classifying_the_path_again(tmp_path, monkeypatch):
    path = save(tmp_path / "step=3", 3, {"w": torch.arange(4.0)})
    found = locate(path)
    from lightning_ft.checkpoint import load as load_module

    monkeypatch.setattr(load_module, "is_remote", lambda p: pytest.fail("classified again"))
    loaded = load_checkpoint(found, collective=False)
    assert torch.equal(loaded.state["w"], torch.arange(4.0))


def test_last_paths_are_the_names_lightning_routes_to_last():
    from pathlib import Path

    assert all(is_last_path(Path(n)) for n in ("last.ckpt", "last-v1.ckpt", "last", "d/last.ckpt"))
    assert not any(is_last_path(Path(n)) for n in ("step=3.ckpt", "lastly.ckpt", "last-best.ckpt"))
