"""A pipeline checkpoint saves each stage once and resumes on another data-parallel size and another pipeline split.

Saved on 4 ranks as 2 stages x 2 data-parallel replicas, the checkpoint holds each stage's state once (in the rank
state of replica 0). Resumed on 2 ranks (2 stages, 1 replica) and on 4 ranks re-split into 4 stages, with
``keep_global`` doubling the accumulation, the run continues with the losses of the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lightning_ft.checkpoint import list_committed
from lightning_ft.checkpoint.commit import read_document
from lightning_ft.events import read_events
from tests.e2e._torchrun import assert_ok, torchrun

pytestmark = pytest.mark.slow


def losses(out):
    """Global mean loss per optimizer step (ElasticRecord: averaged over every rank and micro-batch)."""
    lines = (out / "losses_rank0.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_pipeline_stages_are_saved_once_and_resume_on_another_data_parallel_size_and_split(tmp_path):
    common = ["--max-steps", "8", "--ckpt-every", "4", "--samples", "64", "--elastic-record"]
    ref = tmp_path / "ref"
    assert_ok(torchrun("--root", str(ref), "--out", str(ref / "out"), "--pp", "2", *common, nproc=4))
    step4 = next(c.path for c in list_committed(ref / "ckpt") if c.step == 4)
    document = read_document(step4)
    # Ranks 0, 1 are stage 0's replicas, ranks 2, 3 stage 1's: replica 0 of each stage writes it, once.
    with_stage = [r for r, state in enumerate(document["rank_states"]) if "stage" in state]
    assert with_stage == [0, 2]
    reference = losses(ref / "out")

    for name, pp, nproc in (("dp1", "2", 2), ("pp4", "4", 4)):
        run = tmp_path / name
        (run / "ckpt").mkdir(parents=True)
        shutil.copytree(step4, run / "ckpt" / step4.name)
        assert_ok(torchrun("--root", str(run), "--out", str(run / "out"), "--pp", pp, *common, nproc=nproc))
        (event,) = [e for e in read_events(run) if e["event"] == "resumed"]
        assert event["saved_mesh"]["pipeline_parallel"] == 2 and event["mesh"]["pipeline_parallel"] == int(pp)
        assert event["accumulate_grad_batches"] == 2  # data-parallel size 2 -> 1, global batch kept
        resumed = losses(run / "out")
        assert sorted(resumed) == list(range(5, 9))
        for step in range(5, 9):
            assert resumed[step] == pytest.approx(reference[step], rel=1e-4), (name, step)
