"""At 2 processes (gloo, real torchrun; ElasticFT3D writing its default, the file, and torchsnapshot folders) a callback's ``Counter`` and a module's namedtuple,
``OrderedDict`` and ``frozenset`` come back from a resume as the types they come back as under ``DDPStrategy``."""

from __future__ import annotations

import json

import pytest

from tests.e2e._torchrun import assert_ok, torchrun

SCRIPT = __import__("pathlib").Path(__file__).with_name("object_types_script.py")


@pytest.mark.slow
def test_objects_come_back_as_their_types_at_two_processes_as_under_ddp(tmp_path):
    seen = {}
    runs = {"ddp": [], "elasticft": [], "elasticft-torchsnapshot": ["--checkpoint-format", "torchsnapshot"]}
    for name, extra in runs.items():
        out = tmp_path / name / "out"
        strategy = name.split("-")[0]
        root = tmp_path / name
        assert_ok(torchrun("--strategy", strategy, "--root", str(root), "--out", str(out), *extra, script=SCRIPT))
        seen[name] = [json.loads((out / f"types_rank{r}.json").read_text()) for r in range(2)]
    assert (tmp_path / "elasticft" / "checkpoints" / "epoch=0-step=2.ckpt").is_file()
    assert (tmp_path / "elasticft-torchsnapshot" / "checkpoints" / "epoch=0-step=2.ckpt").is_dir()
    expected = {"counter": "Counter", "point": "Point", "ordered": "OrderedDict", "tags": "frozenset"}
    assert seen["ddp"] == [expected, expected]
    assert seen["elasticft"] == seen["ddp"]
    assert seen["elasticft-torchsnapshot"] == seen["ddp"]
