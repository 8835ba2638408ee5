"""The replica mode's events in the report and in GoodputMonitor: a lost group's stall is lost time, counted once
however many survivors recorded it; a heal is the joining group's recovery; the live groups are shown per step.

The history ``histories/replicas`` is written as the strategy writes these events (fields as docs/replica-groups-reference.md
lists them): one attempt of 2 ranks, 3 groups; group g2 is lost at step 13 (both ranks record it, with stalls of
1.5 s and 1.25 s) and g3 joins and heals at step 25.
"""

from __future__ import annotations

import csv
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.cli import main
from lightning_ft.events import get_event_log, is_incident
from lightning_ft.monitors import GoodputMonitor
from lightning_ft.monitors.goodput_text import format_report
from lightning_ft.monitors.replica_goodput import ReplicaTally, read_new_lines
from tests.monitors.test_goodput_report import HISTORIES, report
from tests.monitors.tiny_module import TinyModule


def test_a_lost_group_s_discarded_step_is_lost_time_and_its_wait_is_not_counted_twice():
    s = report("replicas")
    t = s["totals"]
    # wall 1051 - 1000 = 51 s; productive 3 x 8 = 24 s, over 30 committed steps and 1 discarded: the discarded step's
    # share, 24/31 s, is lost. The rest of the 1.5 s stall (the longer record) is the wait for the next quorum, before
    # a batch's start hook: outside the productive time already, so it lowers the ETTR once, through the wall time.
    assert (t["wall_s"], t["productive_s"], t["replica_stall_s"]) == (51.0, 24.0, 1.5)
    assert t["lost_s"] == t["replica_discarded_s"] == pytest.approx(24 / 31)
    assert t["useful_productive_s"] == pytest.approx(24 - 24 / 31)
    assert s["ettr"] == pytest.approx((24 - 24 / 31) / 51)
    # Device time: 2 ranks x (24 - 24/31) s useful of 2 x 51 s held.
    assert s["device_utilisation"] == pytest.approx(2 * (24 - 24 / 31) / (2 * 51))
    assert (t["replicas_lost"], t["replicas_joined"], t["discarded_steps"], t["heal_s"]) == (1, 1, 1, 2.0)
    # No restart: a lost group is not an attempt that ended.
    assert (t["attempts"], t["restarts"], t["restart_s"]) == (1, 0, 0)


def test_every_survivor_s_record_of_a_lost_group_counts_once():
    s = report("replicas")
    r = s["replicas"]
    assert r["lost"] == [
        {"time": 1033.0, "step": 13, "attempt": 0, "replica_id": "g2", "stall_s": 1.5, "discarded_steps": 1}
    ]
    assert [h["replica_id"] for h in r["heals"]] == ["g3"] and r["heal_bytes"] == 12_000_000
    (incident,) = s["incidents"]
    assert (incident["event"], incident["replica_id"], incident["ranks_recorded"]) == ("replica_lost", "g2", [0, 1])


def test_the_live_groups_are_kept_where_they_change():
    r = report("replicas")["replicas"]
    assert r["live_groups"] == [[1, 3], [13, 2], [25, 3]]
    assert (r["min_live_groups"], r["last_live_groups"]) == (2, 3)


def test_the_text_report_names_the_losses_the_heals_and_the_live_groups():
    text = format_report(report("replicas"))
    assert (
        "  replica groups: 1 lost (survivors stalled 1.5s, 1 discarded step(s)), 1 joined, 1 healed (2.0s, 12.0 MB"
        " from live peers); live groups 3 -> 2 -> 3 (fewest 2)"
    ) in text
    assert "    step 13: group g2 lost, survivors stalled 1.5s, 1 discarded step(s)" in text
    assert "    step 25: group g3 healed from group g0: 12.0 MB in 2.0s" in text
    assert "incidents: 1 replica_lost" in text


def test_lightning_ft_report_prints_and_dumps_the_replica_summary(capsys):
    assert main(["report", str(HISTORIES / "replicas")]) == 0
    assert "replica groups: 1 lost" in capsys.readouterr().out
    assert main(["report", str(HISTORIES / "replicas"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["replicas"]["stall_s"] == 1.5 and summary["totals"]["replica_stall_s"] == 1.5


def test_a_run_without_replica_events_has_no_replica_summary():
    s = report("finished")
    assert s["replicas"] is None and s["totals"]["replica_stall_s"] == 0
    assert "replica groups" not in format_report(s)


def test_a_lost_group_makes_an_in_memory_event_log_write_itself_to_disk():
    assert is_incident("replica_lost", {"replica_id": "g2"})
    assert not is_incident("replica_joined", {}) and not is_incident("replica_quorum", {})


def test_new_lines_are_read_once_and_a_line_being_written_waits(tmp_path):
    path = tmp_path / "rank0.jsonl"
    assert read_new_lines(path, 0) == ([], 0)
    path.write_text('{"event": "a"}\n{"event": "b"')
    lines, offset = read_new_lines(path, 0)
    assert lines == [{"event": "a"}] and offset == len('{"event": "a"}\n')
    with open(path, "a") as f:
        f.write("}\n")
    assert read_new_lines(path, offset)[0] == [{"event": "b"}]


def test_the_tally_counts_only_its_own_attempt():
    tally = ReplicaTally(run_id="r", attempt=1)
    lost = {"event": "replica_lost", "run_id": "r", "replica_id": "g1", "step": 4, "stall_s": 2.0, "discarded_steps": 1}
    tally.add([lost | {"attempt": 0}, {"event": "progress", "run_id": "r", "attempt": 1}])
    assert tally.stall_s == 0.0 and tally.live_groups is None
    tally.add(
        [lost | {"attempt": 1}, {"event": "replica_quorum", "run_id": "r", "attempt": 1, "step": 4, "live_groups": 2}]
    )
    assert (tally.stall_s, tally.live_groups, tally.total("discarded_steps")) == (2.0, 2, 1.0)


class ReplicaEvents(Callback):
    """Writes the replica events as the strategy does: 3 groups, g2 lost at step 4 (stall 0.25 s), g3 joined and
    healed at step 7."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        log, step = get_event_log(trainer), trainer.global_step
        if step == 1:
            log.write("replica_quorum", step=step, live_groups=3)
        if step == 4:
            log.write("replica_lost", step=step, replica_id="g2", stall_s=0.25, discarded_steps=1)
            log.write("replica_quorum", step=step, live_groups=2)
        if step == 7:
            log.write("replica_joined", step=step, replica_id="g3")
            log.write("healed", step=step, replica_id="g3", source="g0", bytes=4096, seconds=0.5)
            log.write("replica_quorum", step=step, live_groups=3)


def fit_with_replica_events(root, monitor: GoodputMonitor, steps: int = 10) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=root,
        logger=CSVLogger(root, name="logs", version=0),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ReplicaEvents(), monitor],
    )
    trainer.fit(TinyModule(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2))
    return trainer


def logged_rows(root) -> list[dict[str, str]]:
    with open(root / "logs" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_goodput_monitor_counts_the_discarded_step_as_lost_and_leaves_the_live_groups_to_the_strategy(tmp_path):
    monitor = GoodputMonitor()
    fit_with_replica_events(tmp_path, monitor)
    rows = logged_rows(tmp_path)
    # One tag for the live groups: the strategy's replica/live_groups (docs/monitors.md); the monitor logs none.
    assert not [tag for row in rows for tag, value in row.items() if "live_groups" in tag and value]
    totals = monitor.totals()
    assert (totals["replica_stall_s"], totals["replicas_lost"], totals["replicas_joined"]) == (0.25, 1.0, 1.0)
    assert (totals["heal_s"], totals["discarded_steps"]) == (0.5, 1.0)
    # The discarded step's share of the productive time (10 committed steps and 1 discarded), not the stall's wait.
    assert totals["lost_s"] == pytest.approx(totals["productive_s"] / 11)
    assert totals["useful_productive_s"] == pytest.approx(totals["productive_s"] * 10 / 11)
    last = [r for r in rows if r.get("goodput/replica_stall_s")][-1]
    assert float(last["goodput/replica_stall_s"]) == 0.25 and float(last["goodput/heal_s"]) == 0.5


def test_the_timeline_marks_the_lost_group():
    plt = pytest.importorskip("matplotlib.pyplot")
    from lightning_ft.monitors.goodput_report import timeline_figure
    from tests.monitors.test_goodput_report import history

    fig = timeline_figure(history("replicas"))
    try:
        assert "replica_lost" in fig.axes[0].get_legend_handles_labels()[1]
    finally:
        plt.close(fig)


def test_a_duplicate_id_and_an_orphaned_worker_are_incidents_in_the_report():
    from lightning_ft.events import read_events
    from lightning_ft.monitors.goodput_report import summarize

    events = read_events(HISTORIES / "replicas")
    end = max(e["time"] for e in events)
    base = {"run_id": events[0]["run_id"], "attempt": 0, "rank": 0}
    events += [
        base | {"time": end + 1, "event": "replica_duplicate", "step": 30, "replica_id": "g0", "others": ["g0:u2"]},
        base | {"time": end + 2, "event": "replica_orphaned", "step": 31, "replica_id": "g1", "parent_pid": 1},
    ]
    incidents = {i["event"]: i for i in summarize(events)["incidents"]}
    assert incidents["replica_duplicate"]["others"] == ["g0:u2"]
    assert incidents["replica_orphaned"]["parent_pid"] == 1
    assert is_incident("replica_orphaned", {}) and is_incident("replica_duplicate", {})
    assert "1 replica_duplicate" in format_report(summarize(events))
