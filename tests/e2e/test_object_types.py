"""At 2 processes (folders under ElasticFT3D, gloo, real torchrun) a callback's ``Counter`` and a module's namedtuple,
``OrderedDict`` and ``frozenset`` come back from a resume as the types they come back as under ``DDPStrategy``."""

from __future__ import annotations

import json

import pytest

from tests.e2e._torchrun import assert_ok, torchrun

SCRIPT = __import__("pathlib").Path(__file__).with_name("object_types_script.py")


@pytest.mark.slow
def test_objects_come_back_as_their_types_at_two_processes_as_under_ddp(tmp_path):
    seen = {}
    for strategy in ("ddp", "elasticft"):
        out = tmp_path / strategy / "out"
        assert_ok(
            torchrun("--strategy", strategy, "--root", str(tmp_path / strategy), "--out", str(out), script=SCRIPT)
        )
        seen[strategy] = [json.loads((out / f"types_rank{r}.json").read_text()) for r in range(2)]
    expected = {"counter": "Counter", "point": "Point", "ordered": "OrderedDict", "tags": "frozenset"}
    assert seen["ddp"] == [expected, expected]
    assert seen["elasticft"] == seen["ddp"]
