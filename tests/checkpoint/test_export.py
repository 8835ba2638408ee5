"""The export writes a plain torch.save file one tensor at a time; sharded tensors come out whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_ft._compat import DTensor, Shard
from lightning_ft.checkpoint import AsyncCheckpointer
from lightning_ft.checkpoint.export import _by_position, exported_checkpoint
from lightning_ft.checkpoint.internal import export_checkpoint
from lightning_ft.checkpoint.torch_file import TensorSlot, save_streaming
from tests.helpers import run_distributed

TENSORS = {
    "w": torch.randn(5, 7),
    "half": torch.randn(3, 2).to(torch.bfloat16),
    "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "mask": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
    "complex": torch.randn(2, dtype=torch.complex64),
}


def _slot(key):
    t = TENSORS[key]
    return TensorSlot(key, t.dtype, tuple(t.shape))


def test_a_streamed_file_is_an_ordinary_torch_save_file(tmp_path):
    obj = {"a": {k: _slot(k) for k in TENSORS}, "b": [_slot("w"), (1, "x")], "n": None}
    produced = []

    def produce(slot):
        produced.append(slot.key)
        return TENSORS[slot.key].clone()

    out = save_streaming(obj, tmp_path / "f.ckpt", produce)
    assert "empty" not in produced and produced.count("w") == 2
    for mmap in (False, True):
        loaded = torch.load(out, weights_only=True, mmap=mmap)
        for k, t in TENSORS.items():
            assert loaded["a"][k].dtype == t.dtype and torch.equal(loaded["a"][k], t), k
        assert torch.equal(loaded["b"][0], TENSORS["w"]) and loaded["b"][1] == (1, "x") and loaded["n"] is None
    assert [p.name for p in tmp_path.iterdir()] == ["f.ckpt"]  # no temporary file left


def test_a_producer_of_the_wrong_shape_fails_and_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="expected torch.float32 \\[5, 7\\]"):
        save_streaming({"w": _slot("w")}, tmp_path / "f.ckpt", lambda s: torch.zeros(3))
    assert list(tmp_path.iterdir()) == []


def test_optimizer_state_by_parameter_name_becomes_positional_as_optimizer_state_dict_is():
    by_name = {
        "state": {"b.weight": {"exp_avg": 2}, "a.weight": {"exp_avg": 1}},
        "param_groups": [{"lr": 0.1, "params": ["a.weight"]}, {"lr": 0.2, "params": ["b.weight", "c.bias"]}],
    }
    assert _by_position(by_name) == {
        "state": {1: {"exp_avg": 2}, 0: {"exp_avg": 1}},
        "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1, 2]}],
    }


FULL = torch.arange(48, dtype=torch.float32).reshape(8, 6)


def _save_sharded(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    weight = DTensor.from_local(FULL.chunk(world_size)[rank].clone(), mesh, [Shard(0)])
    state = {"state_dict": {"net.weight": weight, "net.bias": torch.ones(6)}, "hyper_parameters": {"lr": 0.1}}
    writer = AsyncCheckpointer()
    writer.save(Path(root) / "ckpt", state, metadata={"step": 3})
    writer.close()
    dist.barrier()


def test_export_of_a_checkpoint_sharded_over_two_ranks_holds_whole_tensors(tmp_path):
    run_distributed(_save_sharded, 2, str(tmp_path))
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "plain.ckpt")
    plain = torch.load(out, weights_only=True)
    assert torch.equal(plain["state_dict"]["net.weight"], FULL)
    assert torch.equal(plain["state_dict"]["net.bias"], torch.ones(6))
    assert plain["global_step"] == 3 and plain["hyper_parameters"] == {"lr": 0.1}


def test_an_allowed_object_in_the_hyperparameters_is_exported_as_itself_tensors_included(tmp_path):
    # pytorch-forecasting keeps its loss (an nn.Module) in its hyperparameters and asserts its type in __init__: a
    # text stand-in made load_from_checkpoint of the exported file fail.
    loss = torch.nn.Linear(2, 1)
    free = torch.nn.ReLU()  # a module without tensors
    state = {"state_dict": {"net.bias": torch.ones(6)}, "hyper_parameters": {"loss": loss, "act": free, "lr": 0.1}}
    with torch.serialization.safe_globals([torch.nn.Linear, torch.nn.ReLU]):
        writer = AsyncCheckpointer()
        writer.save(tmp_path / "ckpt", state, metadata={"step": 1})
        writer.close()
        in_memory = exported_checkpoint(tmp_path / "ckpt")["hyper_parameters"]
        assert type(in_memory["loss"]) is torch.nn.Linear and torch.equal(in_memory["loss"].weight, loss.weight)
        for full in (False, True):
            out = export_checkpoint(tmp_path / "ckpt", tmp_path / f"plain{full}.ckpt", full=full)
            hparams = torch.load(out, weights_only=True)["hyper_parameters"]
            assert type(hparams["act"]) is torch.nn.ReLU and hparams["lr"] == 0.1
            # Its weights are in the file (a streamed skeleton would leave them zero): itself, never its text.
            assert type(hparams["loss"]) is torch.nn.Linear, hparams["loss"]
            assert torch.equal(hparams["loss"].weight, loss.weight) and torch.equal(hparams["loss"].bias, loss.bias)
            assert torch.equal(torch.load(out, weights_only=True)["state_dict"]["net.bias"], torch.ones(6))


def test_the_modules_own_top_level_keys_are_exported_and_training_state_only_with_full(tmp_path):
    # pytorch-forecasting's on_save_checkpoint adds "__special_save__", which its on_load_checkpoint reads back.
    state = {
        "state_dict": {"net.bias": torch.ones(6)},
        "hyper_parameters": {"lr": 0.1},
        "__special_save__": {"names": ["loss"], "version": 2},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "lr_schedulers": [{"last_epoch": 3}],
    }
    writer = AsyncCheckpointer()
    writer.save(tmp_path / "ckpt", state, metadata={"step": 1})
    writer.close()
    assert exported_checkpoint(tmp_path / "ckpt")["__special_save__"] == {"names": ["loss"], "version": 2}
    plain = torch.load(export_checkpoint(tmp_path / "ckpt", tmp_path / "plain.ckpt"), weights_only=True)
    assert plain["__special_save__"] == {"names": ["loss"], "version": 2}
    assert "optimizer_states" not in plain and "lr_schedulers" not in plain
    full = torch.load(export_checkpoint(tmp_path / "ckpt", tmp_path / "full.ckpt", full=True), weights_only=True)
    assert full["__special_save__"] == {"names": ["loss"], "version": 2}
    assert full["lr_schedulers"] == [{"last_epoch": 3}]
