"""Runs of Lightning's own strategies continue under ElasticFT3D, sharded, at another data-parallel size."""

from __future__ import annotations

import pytest
import torch

from tests.e2e._torchrun import SCRIPT as _TRAIN_SCRIPT
from tests.e2e._torchrun import assert_ok, torchrun

pytestmark = pytest.mark.slow

SCRIPT = _TRAIN_SCRIPT.with_name("interop_script.py")


def _run(tmp_path, strategy, out, *, nproc, ckpt_path=None, fsdp=True):
    args = ["--strategy", strategy, "--root", str(tmp_path), "--max-steps", "4", "--out", str(tmp_path / out)]
    if fsdp:
        args.append("--fsdp")
    if ckpt_path is not None:
        args += ["--ckpt-path", str(ckpt_path)]
    proc = torchrun(*args, nproc=nproc, script=SCRIPT)
    assert_ok(proc)
    return torch.load(tmp_path / out / "final.pt", weights_only=True), proc


def _assert_same_training_state(saved, restored):
    assert restored["step"] == saved["step"] == 4
    for name, tensor in saved["weights"].items():
        assert torch.equal(restored["weights"][name], tensor), name
    for name, state in saved["optim"].items():
        for key, tensor in state.items():
            assert torch.equal(restored["optim"][name][key], tensor), (name, key)


def test_a_model_parallel_strategy_folder_continues_under_elasticft3d_on_fewer_ranks(tmp_path):
    saved, _ = _run(tmp_path, "modelparallel", "mp", nproc=2)
    folder = tmp_path / "modelparallel" / "epoch=0-step=4.ckpt"
    assert (folder / ".metadata").is_file() and (folder / "meta.pt").is_file()
    restored, proc = _run(tmp_path, "elasticft", "ft", nproc=1, ckpt_path=folder)
    _assert_same_training_state(saved, restored)
    assert "imported the ModelParallelStrategy distributed checkpoint" in proc.stderr


def test_a_model_parallel_strategy_folder_of_a_plain_module_continues_with_its_optimizer_state(tmp_path):
    # The module is not parallelized: it is restored before the strategy's setup, as under DDPStrategy, before its
    # optimizers exist; their state is read from the folder when Lightning restores the optimizers.
    saved, _ = _run(tmp_path, "modelparallel", "mp", nproc=1, fsdp=False)
    folder = tmp_path / "modelparallel" / "epoch=0-step=4.ckpt"
    assert (folder / ".metadata").is_file()
    restored, proc = _run(tmp_path, "elasticft", "ft", nproc=1, ckpt_path=folder, fsdp=False)
    _assert_same_training_state(saved, restored)
    assert "imported the ModelParallelStrategy distributed checkpoint" in proc.stderr


@pytest.mark.extended
def test_a_ddp_strategy_file_loads_into_fsdp_sharded_parameters_on_two_ranks(tmp_path):
    saved, _ = _run(tmp_path, "ddp", "ddp", nproc=1, fsdp=False)
    restored, _ = _run(tmp_path, "elasticft", "ft", nproc=2, ckpt_path=tmp_path / "ddp" / "epoch=0-step=4.ckpt")
    _assert_same_training_state(saved, restored)
