"""FaultInjector: building faults, and the storage seam it wraps (real OSErrors, real stalls, real signals)."""

from __future__ import annotations

import errno
import signal
import time
from pathlib import Path

import pytest

from lightning_ft.fault import FaultInjector


class RecordingStorage:
    def __init__(self) -> None:
        self.writes: list[Path] = []

    def write(self, path, entries, *, group):
        self.writes.append(Path(path))

    def reader(self, path):
        return ("reader", path)


def test_a_spec_string_builds_the_same_faults_as_the_fluent_calls():
    spec = "signal_at:rank=1,step=3,sig=SIGUSR1,during=write;hang_at:rank=0,step=5,where=step,seconds=2.5,attempt=None"
    built = FaultInjector.from_spec(spec)
    fluent = (
        FaultInjector()
        .signal_at(rank=1, step=3, sig=signal.SIGUSR1, during="write")
        .hang_at(rank=0, step=5, where="step", seconds=2.5, attempt=None)
    )
    assert [(f.kind, f.rank, f.step, f.attempt, f.params) for f in built.faults] == [
        (f.kind, f.rank, f.step, f.attempt, f.params) for f in fluent.faults
    ]
    assert FaultInjector.from_spec("").faults == []


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda i: i.fail_at(rank=-1, step=2), "rank=-1"),
        (lambda i: i.signal_at(rank=0, step=1, during="lunch"), "during='lunch'"),
        (lambda i: i.hang_at(rank=0, step=1, where="gpu"), "where='gpu'"),
        (lambda i: i.slow_rank(rank=0, ms=-5), "ms=-5"),
        (lambda i: i.slow_network(rank=0, ms=-1), r"slow_network\(ms=-1\)"),
        (lambda i: FaultInjector.from_spec("explode:rank=1"), "unknown fault 'explode'"),
    ],
)
def test_bad_faults_are_refused_when_added(call, match):
    with pytest.raises(ValueError, match=match):
        call(FaultInjector())


def test_a_storage_error_fails_the_matching_write_after_taking_part_in_it():
    inner = RecordingStorage()
    injector = FaultInjector().storage_error_at(rank=0, step=4, errno="EIO")
    storage = injector.wrap_storage(inner)
    storage.write(Path("ckpt/epoch=0-step=2.ckpt"), {}, group=None)
    with pytest.raises(OSError) as raised:
        storage.write(Path("ckpt/epoch=0-step=4.ckpt"), {}, group=None)
    assert raised.value.errno == errno.EIO
    assert [p.name for p in inner.writes] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]  # it did take part
    storage.write(Path("ckpt/epoch=0-step=4.ckpt"), {}, group=None)  # once only
    assert storage.reader("x") == ("reader", "x")  # everything else is the inner storage's


def test_faults_fire_only_on_their_rank_and_attempt():
    inner = RecordingStorage()
    injector = FaultInjector().storage_error_at(rank=1, step=None).storage_error_at(rank=0, step=None, attempt=1)
    storage = injector.wrap_storage(inner)
    injector._rank, injector._attempt = 0, 0
    storage.write(Path("ckpt/a"), {}, group=None)  # rank 0, attempt 0: neither fault is due
    injector._attempt = 1
    with pytest.raises(OSError) as raised:
        storage.write(Path("ckpt/b"), {}, group=None)
    assert raised.value.errno == errno.ENOSPC


def test_a_storage_stall_delays_the_write_and_a_signal_can_arrive_during_it():
    received = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: received.append(time.monotonic()))
    try:
        injector = (
            FaultInjector()
            .storage_stall_at(rank=0, step=6, seconds=0.3)
            .signal_at(rank=0, step=6, sig="USR2", during="write")
        )
        assert injector.has_storage_faults
        storage = injector.wrap_storage(RecordingStorage())
        start = time.monotonic()
        storage.write(Path("ckpt/preempt-step=6"), {}, group=None)
        assert time.monotonic() - start >= 0.3
        assert len(received) == 1
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_slow_network_delays_the_ranks_collectives_and_sends_from_its_step_until_fit_ends(monkeypatch):
    import torch.distributed as dist

    calls = []

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append(("all_reduce", tensor))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    originals = {name: getattr(dist, name) for name in ("all_reduce", "send", "barrier", "recv")}
    injector = FaultInjector.from_spec("slow_network:rank=0,ms=30,from_step=4")
    trainer = type("T", (), {"global_step": 3})()
    injector.on_train_batch_start(trainer, None, None, 0)
    assert all(getattr(dist, name) is fn for name, fn in originals.items())  # not before its step
    trainer.global_step = 4
    injector.on_train_batch_start(trainer, None, None, 0)
    assert all(getattr(dist, name) is not originals[name] for name in ("all_reduce", "send", "barrier"))
    assert dist.recv is originals["recv"]  # the sender's delay reaches the receiver
    monkeypatch.setattr(time, "sleep", lambda seconds: calls.append(("sleep", seconds)))
    dist.all_reduce("x")
    assert calls == [("sleep", 0.03), ("all_reduce", "x")]  # 30 ms late, then the real call
    injector.on_exception(trainer, None, RuntimeError("stop"))  # before the strategy's teardown undoes its own
    assert all(getattr(dist, name) is fn for name, fn in originals.items())
