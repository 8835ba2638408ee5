"""A module without parallelization trains under ElasticFT3D exactly like under Lightning's DDPStrategy."""

from __future__ import annotations

import pytest
import torch

from tests.e2e._torchrun import assert_ok, load_run, torchrun

pytestmark = pytest.mark.slow


def test_unparallelized_module_follows_ddp_strategy_loss_trajectory(tmp_path):
    runs = {}
    for strategy in ("ddp", "elasticft"):
        root = tmp_path / strategy
        assert_ok(
            torchrun("--root", str(root), "--out", str(root / "out"), "--strategy", strategy, "--max-steps", "10")
        )
        runs[strategy] = load_run(root / "out")
    (w_ddp, l_ddp), (w_ft, l_ft) = runs["ddp"], runs["elasticft"]
    assert sorted(l_ddp) == sorted(l_ft) == list(range(1, 11))
    assert l_ft == l_ddp
    for name in w_ddp:
        assert torch.equal(w_ft[name], w_ddp[name]), name
