"""The per-rank parts of replica groups of a sharded model (lightning_ft/replica/sharded_sync.py), without torchrun:

- the cross-group average of the local gradient shards, against a fake Manager that stands for a second group (what
  a group without a gradient for a parameter does, buckets, a failed all-reduce);
- the heal of an FSDP2 model's shards and optimizer state into another model's DTensors (one gloo process), and the
  optimizer that has not stepped yet (collecting its sharded state must not start it).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_ft.replica.sharded_sync import ShardedSync, _lazy_optimizer_state_kept, _localized
from tests.helpers import run_distributed

pytest.importorskip("torchft")


class _Work:
    def wait(self) -> bool:
        return True


class _OtherGroup:
    """A Manager whose all-reduce averages with one other group's flat buffer (``other(flat)`` gives it)."""

    def __init__(self, other: Any, *, fail: bool = False) -> None:
        self.other = other
        self.fail = fail
        self.calls = 0

    def allreduce(self, tensor: torch.Tensor) -> _Work:
        self.calls += 1
        if not self.fail:
            tensor.add_(self.other(tensor)).div_(2)
        return _Work()

    def errored(self) -> Any:
        return RuntimeError("peer gone") if self.fail else None


def _sync(module: torch.nn.Module, manager: Any, **kwargs: Any) -> ShardedSync:
    mode = SimpleNamespace(strategy=SimpleNamespace(model=module, optimizers=[]))
    return ShardedSync(mode, manager, **kwargs)  # type: ignore[arg-type]


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))


def test_each_gradient_is_averaged_with_the_other_group_and_a_missing_one_counts_as_zero() -> None:
    module = _module()
    first, second, third = module[0], module[1], module[2]
    first.weight.grad = torch.ones_like(first.weight)
    first.bias.grad = torch.full_like(first.bias, 3.0)
    second.weight.grad = torch.ones_like(second.weight)
    # second.bias: no gradient here, 4.0 in the other group; third: no gradient in any group.
    theirs = {id(first.weight): 3.0, id(first.bias): 1.0, id(second.weight): 1.0, id(second.bias): 4.0}
    params = list(module.parameters())

    def other(flat: torch.Tensor) -> torch.Tensor:
        out, offset = torch.zeros_like(flat), 0
        for p in params:
            n = p.numel()
            out[offset : offset + n] = theirs.get(id(p), 0.0)
            offset += n
        out[offset:] = torch.tensor([1.0 if id(p) in theirs else 0.0 for p in params])  # their "has a gradient" flags
        return out

    manager = _OtherGroup(other)
    _sync(module, manager).average_gradients()
    assert manager.calls == 1  # one bucket: one all-reduce per step
    assert torch.equal(first.weight.grad, torch.full_like(first.weight, 2.0))
    assert torch.equal(first.bias.grad, torch.full_like(first.bias, 2.0))
    assert torch.equal(second.weight.grad, torch.ones_like(second.weight))
    assert torch.equal(second.bias.grad, torch.full_like(second.bias, 2.0))  # (0 + 4) / 2: this group had none
    assert third.weight.grad is None and third.bias.grad is None  # no group had one: the optimizer skips it


def test_buckets_average_the_same_values_as_one_flat_buffer() -> None:
    def run(bucket_bytes: int) -> tuple[list[torch.Tensor], int]:
        module = _module()
        for i, p in enumerate(module.parameters()):
            p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + i
        manager = _OtherGroup(lambda flat: torch.ones_like(flat))
        _sync(module, manager, bucket_bytes=bucket_bytes).average_gradients()
        return [p.grad.clone() for p in module.parameters()], manager.calls

    whole, one = run(1 << 20)
    split, many = run(16)  # at most 4 float32 elements: one parameter per bucket
    assert one == 1 and many == 6
    assert all(torch.equal(a, b) for a, b in zip(whole, split, strict=True))


def test_a_failed_all_reduce_leaves_the_gradients_for_the_discarded_step() -> None:
    module = _module()
    for p in module.parameters():
        p.grad = torch.full_like(p, 5.0)
    _sync(module, _OtherGroup(lambda flat: flat, fail=True)).average_gradients()
    assert all(torch.equal(p.grad, torch.full_like(p, 5.0)) for p in module.parameters())


def test_the_average_runs_after_the_closure_and_returns_its_result() -> None:
    module = _module()
    manager = _OtherGroup(lambda flat: flat)
    order: list[str] = []

    def closure() -> str:
        order.append("closure")
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        return "loss"

    sync = _sync(module, manager)
    assert sync.after_backward(closure)() == "loss"
    assert order == ["closure"] and manager.calls == 1


def _fsdp2(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    fully_shard(module, mesh=mesh)
    return module, torch.optim.AdamW(module.parameters(), lr=0.01)


def _step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    module(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _heal_round_trip(rank: int, world_size: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from lightning_ft.strategy.parallel_modes import DTensorMode

    def mode_of(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> DTensorMode:
        return DTensorMode(SimpleNamespace(model=module, optimizers=[optimizer]))  # type: ignore[arg-type]

    def shards(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _localized(
            {"state_dict": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}
        )

    # A source that stepped twice heals a target that stepped once from another init: the target is then the source.
    source, source_opt = _fsdp2(seed=0)
    target, target_opt = _fsdp2(seed=1)
    for seed in (10, 11):
        _step(source, source_opt, seed)
    _step(target, target_opt, 12)
    sent = _localized(
        {
            "state_dict": get_model_state_dict(source),
            "optimizer_states": [get_optimizer_state_dict(source, source_opt)],
        }
    )
    ShardedSync(mode_of(target, target_opt), manager=None).load_heal_state(sent)
    assert_same(shards(target, target_opt), shards(source, source_opt))
    _step(source, source_opt, 13)  # ... and stays the source, step for step
    _step(target, target_opt, 13)
    assert_same(shards(target, target_opt), shards(source, source_opt))

    # Collecting an unstepped optimizer's sharded state creates it (one step at lr 0); the heal drops it again, and a
    # target that had stepped takes the source's "not stepped yet" (AdamW's bias correction counts from there).
    fresh, fresh_opt = _fsdp2(seed=0)
    with _lazy_optimizer_state_kept([fresh_opt]) as unstepped:
        collected = get_optimizer_state_dict(fresh, fresh_opt)
    assert unstepped == [0] and collected["state"] and not fresh_opt.state
    fresh_opt.param_groups[0]["lr"] = 0.5
    sent = _localized({"state_dict": get_model_state_dict(fresh), "optimizer_states": [{**collected, "state": {}}]})
    sent["optimizer_states"][0]["param_groups"][0]["lr"] = 0.5
    ShardedSync(mode_of(target, target_opt), manager=None).load_heal_state(sent)
    assert not target_opt.state and target_opt.param_groups[0]["lr"] == 0.5
    _step(fresh, fresh_opt, 14)
    _step(target, target_opt, 14)
    assert_same(shards(target, target_opt), shards(fresh, fresh_opt))

    # A shard of another shape (a group sharded otherwise) is refused, naming the tensor.
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    wrong = _localized({"state_dict": other.state_dict(), "optimizer_states": [{"state": {}, "param_groups": []}]})
    with pytest.raises(ValueError, match=r"0\.weight .* shape \(5, 4\)"):
        ShardedSync(mode_of(target, target_opt), manager=None).load_heal_state(wrong)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_a_heal_copies_the_shards_and_optimizer_state_in_place_and_an_unstepped_optimizer_stays_unstepped() -> None:
    run_distributed(_heal_round_trip, 1)
