"""A module without parallelization trains under ElasticFT3D exactly like under Lightning's DDPStrategy, randomness in
the data pipeline included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e._torchrun import assert_ok, load_run, torchrun

pytestmark = pytest.mark.slow

DATA_RANDOMNESS_SCRIPT = Path(__file__).parents[1] / "elastic" / "data_randomness.py"


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


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_augmenting_dataset_with_dropout_on_two_ranks_ends_with_the_weights_of_ddp_strategy(tmp_path, num_workers):
    # The dataset draws torch.rand, np.random and random.random in __getitem__; the model has dropout.
    weights = {}
    for strategy in ("ddp", "elasticft"):
        out = tmp_path / strategy
        args = ["--strategy", strategy, "--num-workers", str(num_workers), "--max-steps", "6", "--out", str(out)]
        assert_ok(torchrun(*args, script=DATA_RANDOMNESS_SCRIPT))
        weights[strategy] = torch.load(out / "weights.pt", weights_only=True)
    for name, tensor in weights["ddp"].items():
        assert torch.equal(weights["elasticft"][name], tensor), name
