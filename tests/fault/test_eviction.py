"""Eviction's pieces without processes: the health record, the cooldown option, the checks, the monitors' dispatch.

The eviction itself (a real slowed node leaving through its torchrun agent) is tests/e2e/test_eviction.py.
"""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest

from lightning_ft import FaultPolicy, StragglerMonitor, ThermalMonitor
from lightning_ft.cli import main
from lightning_ft.fault import eviction
from lightning_ft.fault.internal import (
    NODE_UNAVAILABLE_EXIT_CODE,
    HealthRecord,
    check_can_evict,
    check_record,
    evict_node,
    read_record,
    record_path,
    write_record,
)
from lightning_ft.monitors import straggler_monitor, thermal_monitor
from lightning_ft.stop import NodeStop, attempt_end_fields


def _record(host: str = "node-a", *, healthy: bool = False, until_in: float = 600.0) -> HealthRecord:
    now = time.time()
    return HealthRecord(
        host=host,
        healthy=healthy,
        source="straggler",
        reason="rank 3 1.40x the others' own step time",
        time=now,
        until=now + until_in,
        ranks=(2, 3),
        step=120,
        run_id="abc",
        extra={"ratio": 1.4},
    )


def test_a_health_record_is_written_atomically_beside_the_checkpoints_and_read_back(tmp_path):
    record = _record()
    path = write_record(tmp_path, record)
    assert path == tmp_path / "lightning-ft" / "health" / "node-a.json"
    assert sorted(p.name for p in path.parent.iterdir()) == ["node-a.json"]  # no temporary file left
    assert read_record(tmp_path, "node-a") == record
    assert json.loads(path.read_text())["until"] == record.until  # plain JSON, for any tool


def test_a_record_replaces_the_previous_one_of_the_same_node(tmp_path):
    write_record(tmp_path, _record())
    write_record(tmp_path, _record(healthy=True))
    assert read_record(tmp_path, "node-a").healthy


def test_host_names_become_safe_file_names(tmp_path):
    assert record_path(tmp_path, "a/b c:1").name == "a_b_c_1.json"


def test_a_node_refuses_only_while_unhealthy_and_within_its_cooldown(tmp_path):
    sick = _record()
    assert sick.refuses(sick.time + 1) and not sick.refuses(sick.until + 1)
    assert not _record(healthy=True).refuses()
    write_record(tmp_path, sick)
    line = check_record(tmp_path, "node-a")
    assert line is not None and "\n" not in line
    assert line.startswith("lightning-ft: node 'node-a' refuses to join: evicted by straggler (rank 3 1.40x")
    assert line.endswith(f"exit code {NODE_UNAVAILABLE_EXIT_CODE}")
    assert check_record(tmp_path, "node-a", now=sick.until + 1) is None
    assert check_record(tmp_path, "node-b") is None
    assert check_record(tmp_path / "not-yet", "node-a") is None


def test_an_unreadable_record_is_reported_and_read_as_none(tmp_path, caplog):
    path = record_path(tmp_path, "node-a")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert read_record(tmp_path, "node-a") is None
    assert "unreadable health record" in caplog.text


def test_the_node_name_comes_from_the_environment_else_the_host(monkeypatch):
    monkeypatch.setenv("LIGHTNING_FT_NODE_NAME", "rack4-n7")
    assert eviction.node_name() == "rack4-n7"
    monkeypatch.delenv("LIGHTNING_FT_NODE_NAME")
    assert eviction.node_name()


def test_health_gate_exits_69_with_one_line_during_the_cooldown_and_0_otherwise(tmp_path, capsys):
    write_record(tmp_path, _record())
    assert main(["health-gate", "--dirpath", str(tmp_path), "--node", "node-a"]) == NODE_UNAVAILABLE_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refuses to join" in err
    assert main(["health-gate", "--dirpath", str(tmp_path), "--node", "node-b"]) == 0
    assert main(["health-gate", "--dirpath", str(tmp_path / "first-launch"), "--node", "node-a"]) == 0


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (math.inf, ValueError), ("1h", TypeError), (True, TypeError)]
)
def test_fault_policy_rejects_a_bad_cooldown(value, error):
    with pytest.raises(error, match=r"FaultPolicy\(eviction_cooldown_s="):
        FaultPolicy(eviction_cooldown_s=value)


def test_fault_policy_cooldown_defaults_to_an_hour_and_accepts_zero():
    assert FaultPolicy().eviction_cooldown_s == 3600.0
    assert FaultPolicy(eviction_cooldown_s=0).eviction_cooldown_s == 0.0
    with pytest.raises(TypeError, match="refuse_unhealthy_nodes"):
        FaultPolicy(refuse_unhealthy_nodes="yes")


def test_monitors_reject_an_unknown_action_and_a_bad_repeat_count():
    with pytest.raises(ValueError, match="'evict'"):
        StragglerMonitor(action="kick")
    with pytest.raises(ValueError, match=r"ThermalMonitor\(action='kick'\)"):
        ThermalMonitor(action="kick")
    with pytest.raises(ValueError, match=r"ThermalMonitor\(evict_after=0\)"):
        ThermalMonitor(action="evict", evict_after=0)


def test_evicting_outside_torchrun_or_without_restarts_is_refused_before_any_work(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ValueError, match=r"StragglerMonitor\(action='evict'\): not started by torchrun"):
        check_can_evict("StragglerMonitor(action='evict')")
    # A torchrun environment whose parent is not the agent (here: whatever started pytest) is not trusted.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(ValueError, match="is not a torchrun agent"):
        check_can_evict("ThermalMonitor(action='evict')")
    monkeypatch.setattr(eviction, "agent_pid", lambda: 12345)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    with pytest.raises(ValueError, match="--max-restarts=0"):
        check_can_evict("StragglerMonitor(action='evict')")
    # With replica groups nobody restarts: the evicted group leaves, the others keep stepping.
    replica_trainer = SimpleNamespace(strategy=SimpleNamespace(replica_groups=object()))
    check_can_evict("StragglerMonitor(action='evict')", replica_trainer)
    with pytest.raises(ValueError, match="--max-restarts=0"):
        check_can_evict("StragglerMonitor(action='evict')", SimpleNamespace(strategy=SimpleNamespace()))


def _trainer(world_size: int = 4, num_nodes: int = 2) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, num_nodes=num_nodes, global_rank=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ranks": [1], "source": "cosmic_rays"}, "source='cosmic_rays'"),
        ({"ranks": [], "source": "thermal"}, r"ranks=\[\]"),
        ({"ranks": [4], "source": "thermal"}, r"each in 0\.\.3"),
        ({"ranks": [1], "source": "thermal", "cooldown_s": -5}, "cooldown_s=-5"),
    ],
)
def test_evict_node_rejects_bad_arguments_before_any_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        evict_node(_trainer(), reason="r", **kwargs)


def test_a_node_leaves_whole(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert eviction.node_ranks(_trainer(world_size=6, num_nodes=3), [3]) == [2, 3]
    assert eviction.node_ranks(_trainer(world_size=6, num_nodes=3), [0, 5]) == [0, 1, 4, 5]


def test_a_refusal_before_training_is_recorded_as_a_stop_with_its_code():
    fields = attempt_end_fields(NodeStop(69, detail="node 'x' refuses to join"))
    assert fields == {"reason": "stopped", "exit_code": 69, "detail": "node 'x' refuses to join"}


def test_straggler_monitor_evict_hands_the_named_rank_to_evict_node(monkeypatch):
    calls = []
    monkeypatch.setattr(straggler_monitor, "evict_node", lambda trainer, **kw: calls.append(kw))
    monkeypatch.setattr(straggler_monitor, "checkpoint_and_stop", lambda *a, **kw: calls.append("stop"))
    StragglerMonitor(action="evict")._act(_trainer(), 3, 1.5, "compute")
    assert calls[0]["ranks"] == [3] and calls[0]["source"] == "straggler"
    assert (
        calls[0]["reason"] == "rank 3 1.50x the others' own step time; its compute (forward, loss, optimizer step) grew"
    )
    calls.clear()
    StragglerMonitor(action="log")._act(_trainer(), 3, 1.5, "compute")
    assert calls == []


def test_thermal_monitor_evicts_only_after_repeated_slowdown_readings(monkeypatch):
    calls = []
    monkeypatch.setattr(thermal_monitor, "evict_node", lambda trainer, **kw: calls.append(kw))
    monitor = ThermalMonitor(action="evict", evict_after=3, interval=10)
    column = thermal_monitor._SLOWDOWN

    def rows(*slow: int) -> list[list[float]]:
        out = [[0.0] * len(thermal_monitor._LOGGED) for _ in range(4)]
        for r in slow:
            out[r][column] = 1.0
        return out

    for readings in ([2], [2], [], [2], [2]):  # a passing slowdown resets the count
        monitor._count_slowdowns(_trainer(), rows(*readings), act=True)
    assert calls == [] and monitor.throttled_readings == [0, 0, 2, 0]
    monitor._count_slowdowns(_trainer(), rows(2), act=True)
    assert [(c["ranks"], c["source"]) for c in calls] == [([2], "thermal")]
    assert "3 readings in a row, 10 batches apart" in calls[0]["reason"]
    # A power cap is normal under load: it is throttling, not a slowdown that counts.
    reading = {"reasons_bits": 0x4}  # SwPowerCap
    assert ThermalMonitor()._row(reading)[column] == 0.0
    assert ThermalMonitor()._row({"reasons_bits": 0x40})[column] == 1.0  # HwThermalSlowdown


def test_with_replica_groups_the_evicted_group_leaves_with_its_record_and_no_checkpoint(monkeypatch, tmp_path):
    """The group's node writes its record and leaves through its agent; no ``preempt-step`` is saved (the trainer
    here has no ``save_checkpoint``: a save would raise) and nobody is told to restart: the exit is 69, a NodeStop."""
    left: list[bool] = []
    monkeypatch.setattr(eviction, "leave_through_agent", lambda *, signal_agent: left.append(signal_agent))
    trainer = SimpleNamespace(
        world_size=1,
        num_nodes=1,
        global_rank=0,
        local_rank=0,
        is_global_zero=True,
        global_step=28,
        default_root_dir=str(tmp_path),
        checkpoint_callback=None,
        strategy=SimpleNamespace(replica_groups=object(), _replica=SimpleNamespace(replica_id="2"), fault=None),
    )
    with pytest.raises(NodeStop) as stop:
        evict_node(trainer, ranks=[0], source="straggler", reason="replica group 2 11.4x", cooldown_s=60)
    assert stop.value.code == NODE_UNAVAILABLE_EXIT_CODE and "replica group 2" in stop.value.detail
    assert left == [True]
    record = read_record(tmp_path / "checkpoints", eviction.node_name())
    assert record is not None and not record.healthy and record.step == 28 and record.refuses(time.time())
    assert not list((tmp_path / "checkpoints").glob("preempt-step=*"))


@pytest.mark.parametrize("replica_groups", [False, True])
def test_a_failed_periodic_check_s_eviction_line_says_what_happens_in_each_mode(monkeypatch, tmp_path, replica_groups):
    """Without replica groups every rank saves ``preempt-step=<N>`` and the others restart; with them nothing is saved
    and the group leaves the quorum while the others go on: the line (the warning, ``node_evicted``'s reason, the
    health record's) says which."""
    from lightning_ft.fault import fault_handler
    from lightning_ft.fault.health import Failure

    calls = []
    monkeypatch.setattr(fault_handler.eviction, "evict_node", lambda trainer, **kw: calls.append(kw))
    trainer = SimpleNamespace(
        world_size=1,
        global_rank=0,
        global_step=15,
        is_global_zero=True,
        default_root_dir=str(tmp_path),
        checkpoint_callback=None,
        strategy=SimpleNamespace(replica_groups=object() if replica_groups else None),
    )
    handler = fault_handler.FaultHandler(FaultPolicy(health_check_action="evict"))
    handler._health_check_failed(trainer, [Failure(0, "gpu", "2 uncorrected ECC errors")])
    (call,) = calls
    assert call["ranks"] == [0] and call["source"] == "health_check"
    if replica_groups:
        assert "its replica group leaves the quorum without a checkpoint" in call["reason"], call
        assert "preempt-step" not in call["reason"] and "restart" not in call["reason"], call
    else:
        assert "every rank saves" in call["reason"] and "preempt-step=15" in call["reason"], call
