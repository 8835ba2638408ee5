"""A resumed fit restores in Lightning's order: callbacks and the module read their restored state in ``on_fit_start``,
``BackboneFinetuning`` resumes after its unfreeze epoch, ``StochasticWeightAveraging`` keeps its average and leaves the
module's own scheduler alone; each compared with ``DDPStrategy`` running the same script (tests/strategy/
restore_scenarios.py), in one process and in two, and with tensor parallelism (where the callbacks' and the module's
state come before ``on_fit_start`` too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e._torchrun import assert_ok, torchrun
from tests.helpers import as_a_new_process
from tests.strategy.restore_scenarios import fit, observed

SCRIPT = Path(__file__).with_name("restore_scenarios.py")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``resumed(scenario, strategy)``: what the user observes after a fit of 2 epochs and a resumed fit to 4 (one
    process); each pair of fits runs once per module."""
    cache: dict[tuple[str, str], dict[str, Any]] = {}

    def run(scenario: str, strategy: str) -> dict[str, Any]:
        if (scenario, strategy) not in cache:
            root = tmp_path_factory.mktemp(f"{scenario}-{strategy}")
            fit(scenario, strategy, root, 2)
            as_a_new_process()  # the relaunch
            cache[scenario, strategy] = observed(*fit(scenario, strategy, root, 4))
        return cache[scenario, strategy]

    return run


def _assert_trains_on_as_ddp(ddp: dict[str, Any], ft: dict[str, Any]) -> None:
    assert ft["global_step"] == ddp["global_step"]
    assert ft["param_groups"] == ddp["param_groups"]
    assert ft["schedulers"] == ddp["schedulers"]
    for name, tensor in ddp["weights"].items():
        assert torch.equal(ft["weights"][name], tensor), name
    assert ft["momentum"].keys() == ddp["momentum"].keys()
    for name, tensor in ddp["momentum"].items():
        assert torch.equal(ft["momentum"][name], tensor), name


def test_backbone_finetuning_resumed_after_its_unfreeze_epoch_trains_on_as_under_ddp_strategy(resumed):
    ddp = resumed("finetuning", "ddp")
    # The oracle resumed after the unfreeze: the backbone's param group is back and training went on to epoch 4.
    assert [len(g["params"]) for g in ddp["param_groups"]] == [4, 2] and ddp["global_step"] == 16
    _assert_trains_on_as_ddp(ddp, resumed("finetuning", "elasticft"))


def test_callbacks_and_the_module_read_their_restored_state_in_on_fit_start_as_under_ddp_strategy(resumed):
    ddp, ft = resumed("finetuning", "ddp"), resumed("finetuning", "elasticft")
    # 8 batches before the save at the end of epoch 2; the module's marker is the saved global step.
    assert ddp["callback_state_at_fit_start"] == ddp["marker_at_fit_start"] == 8
    assert ft["callback_state_at_fit_start"] == ft["marker_at_fit_start"] == 8
    # The same hooks in the same order: the restore of module and callback state before configure_optimizers and
    # on_fit_start.
    assert ft["hooks"] == ddp["hooks"]
    assert ddp["hooks"].index("callback.load_state_dict") < ddp["hooks"].index("callback.on_fit_start")


def test_stochastic_weight_averaging_resumed_keeps_its_average_and_the_modules_scheduler_as_under_ddp_strategy(
    resumed,
):
    ddp, ft = resumed("swa", "ddp"), resumed("swa", "elasticft")
    assert ddp["schedulers"][0][0] == "SWALR" and ddp["averaged"]["n_averaged"] == 4
    _assert_trains_on_as_ddp(ddp, ft)
    assert ft["averaged"]["n_averaged"] == ddp["averaged"]["n_averaged"]
    for name, tensor in ddp["averaged"]["weights"].items():
        assert torch.equal(ft["averaged"]["weights"][name], tensor), name
    # SWA takes the module's StepLR out of Lightning's restore in on_fit_start (it reads its restored scheduler state
    # there); restored after on_fit_start, the StepLR would be given SWALR's state.
    assert ft["own_scheduler"] == ddp["own_scheduler"]
    assert ft["hooks"] == ddp["hooks"]


def _bitwise(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_bitwise, a, b))
    return a == b


def _torchrun_resumed(root: Path, scenario: str, strategy: str) -> dict[str, Any]:
    """Two fits under torchrun (2 epochs, then resumed to 4); what rank 0 observed after the second (each rank's
    observations of fit N are in ``root/<strategy>-<N>.pt`` and ``.rank<r>.pt``)."""
    for fit_number, epochs in enumerate((2, 4), start=1):
        args = ["--scenario", scenario, "--strategy", strategy, "--root", str(root / strategy)]
        out = root / f"{strategy}-{fit_number}.pt"
        assert_ok(torchrun(*args, "--max-epochs", str(epochs), "--out", str(out), script=SCRIPT, timeout=300))
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.timeout(900)  # four torchrun launches of two processes
def test_backbone_finetuning_resumed_on_two_processes_resumes_with_the_param_groups_of_ddp_strategy(tmp_path):
    ddp = _torchrun_resumed(tmp_path, "finetuning", "ddp")
    ft = _torchrun_resumed(tmp_path, "finetuning", "elasticft")
    assert ddp["global_step"] == ft["global_step"] == 8  # 2 steps per epoch per process
    assert len(ddp["param_groups"]) == 2 and ft["param_groups"] == ddp["param_groups"]
    assert ft["callback_state_at_fit_start"] == ddp["callback_state_at_fit_start"] == 4
    assert ft["hooks"] == ddp["hooks"]
    # The backbone was frozen when DDP wrapped the module, so DDP never averages its gradients after the unfreeze and
    # every rank trains a backbone of its own (the oracle's ranks disagree at the save).
    rank0, rank1 = (torch.load(tmp_path / f"ddp-1{suffix}.pt", weights_only=False) for suffix in ("", ".rank1"))
    assert not torch.equal(rank1["weights"]["backbone.0.weight"], rank0["weights"]["backbone.0.weight"])
    # DDPStrategy's checkpoint holds rank 0's state; so does the file both ranks write (default "auto"), never a mix.
    saved = {
        s: torch.load(tmp_path / s / "ckpt" / "epoch=1-step=4.ckpt", weights_only=False) for s in ("ddp", "elasticft")
    }
    for part in ("state_dict", "optimizer_states"):
        assert _bitwise(saved["elasticft"][part], saved["ddp"][part]), part


@pytest.mark.slow
@pytest.mark.timeout(600)  # two torchrun launches of two processes
def test_tensor_parallel_callbacks_and_the_module_read_their_restored_state_in_on_fit_start(tmp_path):
    # DTensor state is loaded in place into the sharded module and optimizers, which exist only after configure_
    # optimizers; the callbacks' and the module's state still come before on_fit_start, as under DDPStrategy.
    ft = _torchrun_resumed(tmp_path, "tensor_parallel", "elasticft")
    assert ft["global_step"] == 16  # tensor parallel: one data-parallel replica, 4 steps per epoch
    assert ft["callback_state_at_fit_start"] == ft["marker_at_fit_start"] == 8
    hooks = ft["hooks"]
    for restored in ("module.on_load_checkpoint", "callback.load_state_dict"):
        assert hooks.index(restored) < hooks.index("callback.on_fit_start") < hooks.index("module.on_fit_start")
