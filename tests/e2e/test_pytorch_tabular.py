"""pytorch-tabular's ``TabularModel.fit`` (default ``load_best=True``) and ``save_model`` at 2 ranks under torchrun,
under ``DDPStrategy`` and under ``ElasticFT3D`` (benchmarks/third_party/pytorch_tabular_fit.py).

Issue 29: with the checkpoint a folder at 2 processes, ``load_best`` ended rank 0 with ``IsADirectoryError`` right
after training and rank 1 on a gloo error; ``save_model`` failed the same way. Runs only where pytorch_tabular is
importable: it is not a dependency of lightning-ft, and CI does not install it (docs/lightning-compatibility.md says
how to make the venv).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e._torchrun import assert_ok, torchrun
from tests.helpers import REPO_ROOT

pytest.importorskip("pytorch_tabular")

SCRIPT = Path(REPO_ROOT) / "benchmarks" / "third_party" / "pytorch_tabular_fit.py"


@pytest.mark.slow
def test_tabular_model_fit_load_best_and_save_model_at_two_ranks_as_under_ddp_strategy(tmp_path):
    for strategy in ("ddp", "elastic_ft3d"):
        assert_ok(
            torchrun("fit", "--dir", str(tmp_path / strategy), "--strategy", strategy, script=SCRIPT, timeout=600)
        )
    ddp, ours = (json.loads((tmp_path / s / "report-rank0.json").read_text()) for s in ("ddp", "elastic_ft3d"))
    assert ours["best_is_file"] and ours["load_best_equals_best_file"], ours
    assert ours["saved"] == ddp["saved"] and "model.ckpt" in ours["saved"]
    assert ours["global_step"] == ddp["global_step"]
    for name in ("fit_end_weights.pt", "load_best_weights.pt"):
        a, b = (torch.load(tmp_path / s / name, weights_only=True) for s in ("ddp", "elastic_ft3d"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
