"""A model is the same run at every parallel layout: auto-resume compares the names its checkpoint's state dict uses,
not the module's attribute paths (issue 37, item 1).

Lightning's tensor-parallel example wraps every block in ``checkpoint_wrapper`` and FSDP2 only with more than one
data-parallel rank, so its parameter paths change with the layout. Here its own ``parallelize`` runs on meta tensors
in torch's fake process group (one process stands for 4 or 2 ranks; nothing is computed). The run under torchrun,
saved at dp2 x tp2 and resumed at dp1 x tp2, is tests/e2e/test_tensor_parallel_example.py.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

# torch's single-process stand-in for a world of several ranks (collectives return at once), as torch's own tests use
# it. A private name, for tests only.
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_ft.strategy.run_identity import checkpoint_mismatch, module_identity, state_dict_index


def _example_modules() -> tuple[Any, Any]:
    """The example's ``model`` and ``parallelism`` modules (``parallelism`` imports ``model`` by that name), imported
    from their folder without leaving it on ``sys.path`` or their short names in ``sys.modules``."""
    folder = str(Path(__file__).resolve().parents[1] / "e2e" / "tensor_parallel_example")
    names = ("model", "parallelism")
    saved = {name: sys.modules.pop(name, None) for name in names}
    sys.path.insert(0, folder)
    try:
        return tuple(importlib.import_module(name) for name in names)  # type: ignore[return-value]
    finally:
        sys.path.remove(folder)
        for name in names:
            sys.modules.pop(name, None)
            if saved[name] is not None:
                sys.modules[name] = saved[name]


_model, _parallelism = _example_modules()
ModelArgs, Transformer, parallelize = _model.ModelArgs, _model.Transformer, _parallelism.parallelize


class Llama3(L.LightningModule):
    """The example's LightningModule, tiny."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        args = ModelArgs(dim=dim, n_layers=2, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=16)
        self.model = Transformer(args)


@contextmanager
def world(size: int) -> Iterator[None]:
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def parallelized(dp: int, tp: int, **kwargs) -> Llama3:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    with torch.device("meta"):
        module = Llama3(**kwargs)
    parallelize(module.model, device_mesh=mesh)
    return module


def attribute_path_digest(module: nn.Module) -> str:
    """The parameter digest of the previous release: the module's attribute paths, wrappers included."""
    entries = [[name, list(p.shape), str(p.dtype)] for name, p in module.named_parameters()]
    return hashlib.sha256(json.dumps(entries, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_lightnings_tensor_parallel_example_has_one_identity_at_dp2_tp2_and_at_dp1_tp2():
    with world(4):
        wide = parallelized(2, 2)
        assert any("_checkpoint_wrapped_module" in name for name, _ in wide.named_parameters())
        identity, index = module_identity(wide), state_dict_index(wide)
    with world(2):
        narrow = parallelized(1, 2)
        assert not any("_checkpoint_wrapped_module" in name for name, _ in narrow.named_parameters())
        assert module_identity(narrow) == identity
        assert state_dict_index(narrow) == index
        with torch.device("meta"):
            plain = Llama3()
        assert module_identity(plain) == identity  # the unparallelized model: global shapes, the same names


def test_a_checkpoint_of_the_previous_release_written_at_dp2_is_this_runs_at_dp1_by_its_own_state_dict():
    """Its digest took the wrapper paths; its state dict (the names torch.distributed.checkpoint saved) is this
    model's: it is resumed, not skipped as another experiment's."""
    with world(4):
        wide = parallelized(2, 2)
        saved = {"run_identity": {**module_identity(wide), "parameters": attribute_path_digest(wide)}}
        saved_index = state_dict_index(wide)
    with world(2):
        narrow = parallelized(1, 2)
        live = module_identity(narrow)
        assert saved["run_identity"]["parameters"] != live["parameters"]
        assert checkpoint_mismatch(saved, saved_index, live, lambda: state_dict_index(narrow)) is None


def test_another_width_of_the_same_class_is_another_experiment_and_the_reason_names_the_first_difference():
    with world(4):
        wide = parallelized(2, 2, dim=64)
        saved = {"run_identity": module_identity(wide)}
        saved_index = state_dict_index(wide)
    with world(2):
        narrow = parallelized(1, 2)
        reason = checkpoint_mismatch(saved, saved_index, module_identity(narrow), lambda: state_dict_index(narrow))
    assert reason == (
        "its parameters differ from this model's: 'model.freqs_cis' is complex64 [32, 8] in the checkpoint,"
        " complex64 [32, 4] in this model"
    )


class Compiled(L.LightningModule):
    def __init__(self, compiled: bool) -> None:
        super().__init__()
        block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.block = torch.compile(block) if compiled else block  # compiled lazily: nothing runs here


def test_torch_compile_changes_the_names_only_where_the_state_dict_keeps_them():
    """DTensor models save through torch.distributed.checkpoint, which drops ``_orig_mod.``: compiled or not, one
    identity. A data-parallel model saves ``Module.state_dict()``, which keeps it (Lightning's load of one into the
    other fails): two identities, and the reason says it is the same model wrapped otherwise."""
    plain, compiled = Compiled(False), Compiled(True)
    assert module_identity(plain) != module_identity(compiled)
    reason = checkpoint_mismatch(
        {"run_identity": module_identity(compiled)},
        state_dict_index(compiled),
        module_identity(plain),
        lambda: state_dict_index(plain),
    )
    assert reason is not None and "_orig_mod" in reason and "torch.compile" in reason
    with world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
        for module in (plain, compiled):
            parallelize_module(getattr(module.block, "_orig_mod", module.block), mesh, {"0": ColwiseParallel()})
        assert module_identity(plain) == module_identity(compiled)
        assert state_dict_index(plain) == state_dict_index(compiled)


def test_activation_checkpointing_does_not_change_a_data_parallel_models_identity():
    plain = Compiled(False)
    wrapped = Compiled(False)
    wrapped.block = checkpoint_wrapper(wrapped.block)
    assert module_identity(plain) == module_identity(wrapped)
    assert state_dict_index(plain) == state_dict_index(wrapped)
