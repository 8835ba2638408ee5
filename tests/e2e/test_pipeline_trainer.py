"""Pipeline stages inside a real Lightning Trainer under torchrun: same losses as one process, exact resume."""

from __future__ import annotations

import pytest
import torch

from lightning_ft.events import read_events
from tests.e2e._torchrun import assert_ok, load_run, torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    assert_ok(torchrun("--root", str(root), "--out", str(root / "out"), "--max-steps", "8", nproc=1))
    return load_run(root / "out")


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.extended)])
def test_two_pipeline_stages_match_a_single_process_loss_per_step(tmp_path, single_process, schedule):
    out = tmp_path / "out"
    assert_ok(
        torchrun("--root", str(tmp_path), "--out", str(out), "--max-steps", "8", "--pp", "2", "--schedule", schedule)
    )
    weights, losses = load_run(out)
    ref_weights, ref_losses = single_process
    assert sorted(losses) == sorted(ref_losses) == list(range(1, 9))
    for step, ref in ref_losses.items():
        assert abs(losses[step] - ref) <= 1e-4 * abs(ref), (step, losses[step], ref)
    # Each stage saved its own layers; together they are the whole model.
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.extended
def test_pipeline_run_killed_and_restarted_resumes_each_stage_exactly(tmp_path):
    ref_root = tmp_path / "ref"
    common = ["--max-steps", "10", "--pp", "2", "--ckpt-every", "4"]
    assert_ok(torchrun("--root", str(ref_root), "--out", str(ref_root / "out"), *common))
    args = ["--root", str(tmp_path / "run"), "--out", str(tmp_path / "run" / "out"), *common]
    assert torchrun(*args, "--kill-at-step", "6").returncode != 0
    assert_ok(torchrun(*args))
    assert [e["step"] for e in read_events(tmp_path / "run") if e["event"] == "resumed"] == [4]
    weights, losses = load_run(tmp_path / "run" / "out")
    ref_weights, ref_losses = load_run(ref_root / "out")
    for name, ref in ref_weights.items():
        assert torch.equal(weights[name], ref), name
    assert all(losses[s] == ref_losses[s] for s in range(5, 11))
