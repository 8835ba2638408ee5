"""The on-disk contract: format version, metadata file checked against the marker, never unpickled; atomic writes."""

from __future__ import annotations

import json
import pickle
import zlib

import pytest

from lightning_ft.checkpoint import (
    CorruptCheckpointError,
    FormatVersionError,
    UncommittedCheckpointError,
    commit,
    load_checkpoint,
    verify,
)
from lightning_ft.checkpoint.internal import COMMIT_MARKER, FORMAT_VERSION, METADATA_FILE, is_committed
from tests.checkpoint.support import CreatesFileWhenUnpickled, folders_only, save

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


def test_an_unknown_format_version_is_refused(tmp_path):
    folders_only()
    path = save(tmp_path / "c", 1)
    document = json.loads((path / METADATA_FILE).read_text())
    document["format_version"] = 99
    data = json.dumps(document).encode()
    (path / METADATA_FILE).write_bytes(data)
    marker = json.loads((path / COMMIT_MARKER).read_text())
    marker["metadata_crc32"] = zlib.crc32(data)
    (path / COMMIT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(FormatVersionError, match="99"):
        load_checkpoint(path)


def test_a_metadata_file_replaced_by_a_pickle_is_refused_without_unpickling(tmp_path):
    folders_only()
    path = save(tmp_path / "c", 1)
    sentinel = tmp_path / "pwned"
    (path / METADATA_FILE).write_bytes(pickle.dumps(CreatesFileWhenUnpickled(sentinel)))
    with pytest.raises(CorruptCheckpointError, match=METADATA_FILE):
        load_checkpoint(path)
    assert verify(path)
    assert not sentinel.exists()
    # Past the marker's checksum too: the pickle is refused as not being JSON, still without unpickling.
    marker = json.loads((path / COMMIT_MARKER).read_text())
    marker["metadata_crc32"] = zlib.crc32((path / METADATA_FILE).read_bytes())
    (path / COMMIT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        load_checkpoint(path)
    assert not sentinel.exists()


def test_a_metadata_file_changed_after_the_commit_is_refused_because_it_no_longer_matches_its_marker(tmp_path):
    folders_only()
    path = save(tmp_path / "c", 1)
    document = json.loads((path / METADATA_FILE).read_text())
    document["metadata"]["step"] = 2
    (path / METADATA_FILE).write_text(json.dumps(document))
    with pytest.raises(CorruptCheckpointError, match="does not match the checksum in its marker"):
        load_checkpoint(path)
    assert any("checksum" in p for p in verify(path))


def test_the_marker_is_written_last_and_records_the_step_and_the_metadata_checksum(tmp_path, monkeypatch):
    folders_only()
    written = []
    original = commit.atomic_write

    def recording_atomic_write(path, data):
        original(path, data)
        written.append(path.name)

    monkeypatch.setattr(commit, "atomic_write", recording_atomic_write)
    path = save(tmp_path / "c", 7)
    assert written == [METADATA_FILE, COMMIT_MARKER]
    marker = json.loads((path / COMMIT_MARKER).read_text())
    assert marker["step"] == 7 and marker["format_version"] == FORMAT_VERSION
    assert marker["metadata_crc32"] == zlib.crc32((path / METADATA_FILE).read_bytes())
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".") and "tmp" in p.name) == []


def test_uncommit_removes_only_the_marker_so_the_directory_stops_counting_before_it_is_deleted(tmp_path):
    folders_only()
    path = save(tmp_path / "c", 3)
    commit.uncommit(path)
    assert not is_committed(path)
    assert commit.read_document(path, require_commit=False)["metadata"]["step"] == 3
    with pytest.raises(UncommittedCheckpointError, match="no commit marker"):
        commit.read_document(path)
    commit.uncommit(path)  # nothing left to remove: no error


def test_a_directory_without_metadata_or_with_a_damaged_marker_is_refused(tmp_path):
    folders_only()
    (tmp_path / "empty").mkdir()
    with pytest.raises(UncommittedCheckpointError, match=METADATA_FILE):
        commit.read_document(tmp_path / "empty", require_commit=False)
    path = save(tmp_path / "c", 1)
    (path / COMMIT_MARKER).write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="commit marker"):
        load_checkpoint(path)
