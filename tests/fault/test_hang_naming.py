"""Whom a hang names, from recorded heartbeats: the rank that is not waiting in a collective, else the one whose
collective started first. Each case is what the four placements of a stuck rank leave in the heartbeats of 3 ranks
(the multi-process runs of ``test_hang_naming_distributed.py`` record the same), checked against the rule of 0.2.0
(fewest points, then the oldest last point) that named a waiting rank."""

from __future__ import annotations

import dataclasses

from lightning_ft.fault.heartbeat import Heartbeat, Progress, name_culprits


def beat(rank: int, points: int, point: str, at: float, since: float | None = None, collective: str | None = None):
    return Heartbeat(
        rank=rank,
        points=points,
        step=4,
        point=point,
        point_time=at,
        alive_time=99.0,
        in_collective_since=since,
        collective=collective,
    )


def old_rule(beats: dict[int, Heartbeat]) -> int:
    """0.2.0's rule: the fewest points, ties broken by the oldest last point (what the issue saw name rank 1)."""
    fewest = min(b.points for b in beats.values())
    return min((b.point_time, r) for r, b in beats.items() if b.points == fewest)[1]


def named(beats: dict[int, Heartbeat]) -> int:
    return name_culprits(beats, now=100.0, silent_after_s=30.0)["first_rank"]


# Rank 2 stops in a user callback's on_train_batch_end at a step where ModelCheckpoint saves; ranks 0 and 1 wait in
# the save's collectives inside the same hook. All passed the same points; rank 1's last point is the oldest.
CALLBACK_AT_CHECKPOINT = {
    0: beat(0, 15, "after_backward", 50.2, since=50.5, collective="all_gather_object"),
    1: beat(1, 15, "after_backward", 50.0, since=50.3, collective="all_gather_object"),
    2: beat(2, 15, "after_backward", 50.1),
}
# Rank 2 never returns from a data read; ranks 0 and 1 wait in the next backward's all-reduce.
DATA_READ = {
    0: beat(0, 18, "before_backward", 51.0, since=51.0, collective="ddp_backward"),
    1: beat(1, 18, "before_backward", 51.1, since=51.1, collective="ddp_backward"),
    2: beat(2, 16, "batch_end", 50.4),
}
# Rank 2 computes forever in its forward (no collective in it); ranks 0 and 1 wait in backward's all-reduce.
COMPUTE_LOOP = {
    0: beat(0, 18, "before_backward", 51.0, since=51.0, collective="ddp_backward"),
    1: beat(1, 18, "before_backward", 51.1, since=51.1, collective="ddp_backward"),
    2: beat(2, 17, "batch_start", 50.5),
}
# Rank 2 enters an all_reduce that ranks 0 and 1 never join; they go on and wait for it in the next backward.
UNJOINED_COLLECTIVE = {
    0: beat(0, 18, "before_backward", 51.0, since=51.0, collective="ddp_backward"),
    1: beat(1, 18, "before_backward", 51.1, since=51.1, collective="ddp_backward"),
    2: beat(2, 15, "after_backward", 50.1, since=50.6, collective="all_reduce"),
}


def test_the_rank_stuck_in_a_callback_at_a_checkpoint_step_is_named_not_a_rank_waiting_in_the_save():
    assert named(CALLBACK_AT_CHECKPOINT) == 2
    assert name_culprits(CALLBACK_AT_CHECKPOINT, now=100.0, silent_after_s=30.0)["waiting"] == [0, 1]
    assert old_rule(CALLBACK_AT_CHECKPOINT) == 1  # the wrong rank, as in the issue


def test_the_rank_stuck_in_a_data_read_or_a_compute_loop_is_named():
    assert named(DATA_READ) == 2
    assert named(COMPUTE_LOOP) == 2


def test_the_rank_in_a_collective_nobody_joined_is_named_as_the_first_to_wait():
    found = name_culprits(UNJOINED_COLLECTIVE, now=100.0, silent_after_s=30.0)
    assert found["ranks"] == [2] and found["waiting"] == [0, 1, 2]


def test_when_every_rank_waits_the_rank_behind_is_named_though_the_others_entered_their_collective_earlier():
    # As recorded with the unjoined all_reduce in training_step: ranks 0 and 1 reached backward before rank 2
    # reached its all_reduce in the forward.
    beats = {
        0: beat(0, 18, "before_backward", 51.0, since=51.0, collective="ddp_backward"),
        1: beat(1, 18, "before_backward", 51.0, since=51.02, collective="ddp_backward"),
        2: beat(2, 17, "batch_start", 50.9, since=51.03, collective="all_reduce"),
    }
    assert named(beats) == 2
    # With equal points, the one whose collective started first.
    tied = {r: dataclasses.replace(b, points=18) for r, b in beats.items()}
    assert named(tied) == 0


def test_a_rank_not_waiting_is_named_even_when_it_passed_more_points_than_a_waiting_one():
    # Rank 0 spins in a hook after its step; rank 1 already waits in the next collective with fewer points counted.
    beats = {
        0: beat(0, 20, "batch_end", 60.0),
        1: beat(1, 19, "after_backward", 59.0, since=59.5, collective="barrier"),
    }
    assert named(beats) == 0
    assert old_rule(beats) == 1


def test_heartbeats_without_collective_fields_are_read_as_not_waiting():
    old = '{"rank": 1, "points": 3, "step": 1, "point": "batch_end", "point_time": 5.0, "alive_time": 6.0}'
    beat_ = Heartbeat.from_json(old)
    assert beat_.in_collective_since is None and beat_.collective is None


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_progress_reports_the_outermost_collective_and_a_synchronizing_backward_until_the_next_point():
    clock = Clock()
    progress = Progress(clock)
    progress.enter_collective("all_gather_object")
    clock.now = 11.0
    progress.enter_collective("all_gather")  # all_gather_object runs all_gather inside
    beat_ = progress.heartbeat(0)
    assert (beat_.collective, beat_.in_collective_since) == ("all_gather_object", 10.0)
    progress.leave_collective()
    progress.leave_collective()
    assert progress.heartbeat(0).in_collective_since is None
    clock.now = 12.0
    progress.mark_backward(3, synchronizes=True)
    assert (progress.heartbeat(0).collective, progress.heartbeat(0).in_collective_since) == ("ddp_backward", 12.0)
    progress.mark("after_backward", 3)
    assert progress.heartbeat(0).in_collective_since is None
    progress.mark_backward(3, synchronizes=False)  # accumulating under no_sync: no all-reduce in this backward
    assert progress.heartbeat(0).in_collective_since is None


def test_the_collective_wrappers_see_the_training_threads_blocking_calls_only_and_are_undone(monkeypatch):
    import threading

    import torch
    import torch.distributed as dist

    from lightning_ft.fault.collective_waits import collective_patches
    from tests.helpers import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    original = dist.all_reduce
    seen: list[str] = []
    depth = [0]

    def enter(name: str) -> None:
        depth[0] += 1
        if depth[0] == 1:
            seen.append(name)

    def leave() -> None:
        depth[0] -= 1

    dist.init_process_group("gloo", rank=0, world_size=1)
    patches = collective_patches(enter, leave, thread_id=threading.get_ident(), name="test")
    try:
        for patch in patches:
            patch.install()
        dist.all_reduce(torch.ones(1))
        dist.all_gather_object([None], {"a": 1})  # runs all_gather inside: one outermost call
        dist.all_reduce(torch.ones(1), async_op=True).wait()  # waited for in Work.wait, not in the call
        other = threading.Thread(target=dist.barrier)
        other.start()
        other.join()
        assert seen == ["all_reduce", "all_gather_object"] and depth == [0]
    finally:
        for patch in reversed(patches):
            patch.undo()
        dist.destroy_process_group()
    assert dist.all_reduce is original
