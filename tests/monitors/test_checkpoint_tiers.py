"""The report per checkpoint tier, on the recorded history ``histories/tiers`` (and older logs without tiers).

``tiers``: 4 ranks on node-a (ranks 0, 1) and node-b (2, 3). Attempt 0 saves to memory at steps 10..40 (stalls 0.1,
0.2, 0.3, 0.4 s), durably at 20 (a line without ``tier``: stall 1 s) and 40 (3 s); its memory save at step 50 fails
(two ranks record it) and node-b is lost at step 50. Attempt 1 (node-c in its place) rejects a local copy, resumes
from peer copies at step 40, saves to memory at 50 and 60 (0.2 s each) and crashes at step 65. Attempt 2 resumes
from local copies at 60, saves to memory at 70 and 80 (0.3 s), durably at 80 (2 s), and evicts node-c. Attempt 3 (2
ranks) rejects an uncommitted durable checkpoint, resumes durably at 80, saves to memory at 90 and 100 (0.25 s) and
finishes; node-c's two ranks refuse to join. Every number below is computed by hand from those lines.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_ft.events import read_events
from lightning_ft.monitors.checkpoint_tiers import DEFAULT_DURABLE_FRACTION
from lightning_ft.monitors.goodput_report import summarize
from lightning_ft.monitors.goodput_text import format_report

HISTORIES = Path(__file__).parent / "histories"
F = 53 / 419  # the default share of failures that need the durable tier
MTBF = 261.0 / 2  # wall 70.5 + 46 + 43 + 41 s of attempts + 29.5 + 14 + 17 s of gaps; failures: the kill and the crash
# 11 progress intervals of 8 + 1 s over 50 + 25 + 20 + 20 steps, and attempt 1's 5 steps after its last progress line
# (60..65, crashed) at its own 0.8 s per step
STEP_S = (99 + 5 * 0.8) / 115


def history(name: str) -> list[dict]:
    return read_events(HISTORIES / name)


def test_saves_are_counted_per_tier_and_a_line_without_tier_is_durable():
    saves = summarize(history("tiers"))["tiers"]["saves"]
    # Durable: steps 20 (no tier), 40, 80; stalls 1, 3, 2 s; totals 10, 12, 11 s.
    assert saves["durable"] == {
        "count": 3,
        "stall_s": 2.0,
        "total_s": 11.0,
        "size_bytes": 4000.0,
        "peer_bytes": None,
        "failed": 0,
        "failed_reasons": {},
    }
    # Memory: 10 saves, stalls 0.1, 0.2, 0.2, 0.2, 0.25, 0.25, 0.3, 0.3, 0.3, 0.4: median (0.25 + 0.25) / 2.
    memory = saves["memory"]
    assert (memory["count"], memory["stall_s"], memory["total_s"]) == (10, pytest.approx(0.25), 0.5)
    assert (memory["size_bytes"], memory["peer_bytes"]) == (1000.0, 1000.0)
    # The failed save at step 50, recorded by ranks 0 and 2, counts once.
    assert (memory["failed"], memory["failed_reasons"]) == (1, {"/dev/shm full": 1})


def test_restores_count_attempts_per_tier_with_their_load_time_and_lost_steps_per_failure():
    restores = summarize(history("tiers"))["tiers"]["restores"]
    # The kill at step 50 resumed from peer copies at 40: 10 steps again; the crash at 65 from local copies at 60: 5.
    assert restores["peer"] == {
        "attempts": 1,
        "load_s": 1.0,
        "restored_from": {"local": 2, "peer": 2},
        "failures": 1,
        "lost_steps": [10],
        "lost_steps_per_failure": 10.0,
    }
    assert restores["local"] == {
        "attempts": 1,
        "load_s": 0.5,
        "restored_from": {"local": 4},
        "failures": 1,
        "lost_steps": [5],
        "lost_steps_per_failure": 5.0,
    }
    # The eviction's stop committed step 80 and resumed there: a restart, not a failure, nothing lost.
    assert restores["durable"] == {
        "attempts": 1,
        "load_s": 4.0,
        "restored_from": {"durable": 2},
        "failures": 0,
        "lost_steps": [],
        "lost_steps_per_failure": None,
    }
    assert "none" not in restores


def test_rejected_checkpoints_are_counted_per_tier():
    # A local copy with a bad CRC in attempt 1; an uncommitted durable checkpoint (no tier on the line) in attempt 3.
    assert summarize(history("tiers"))["tiers"]["rejected"] == {"durable": 1, "local": 1, "peer": 0}


def test_each_tier_gets_its_young_daly_interval_for_the_share_of_failures_it_recovers():
    s = summarize(history("tiers"))
    durable, memory = s["checkpoint_intervals"]["durable"], s["checkpoint_intervals"]["memory"]
    assert s["checkpoint_interval"] is durable
    assert (durable["mtbf_s"], durable["mtbf_source"]) == (MTBF, "observed")
    # Durable: C = 2 s, MTBF over the 12.6% of failures that need it; now every 20 steps (20 -> 40 in attempt 0).
    assert durable["failure_share"] == pytest.approx(F) == pytest.approx(DEFAULT_DURABLE_FRACTION)
    assert durable["tier_mtbf_s"] == pytest.approx(MTBF / F)
    assert durable["interval_s"] == pytest.approx(math.sqrt(2 * 2.0 * MTBF / F))
    assert durable["interval_steps"] == round(math.sqrt(2 * 2.0 * MTBF / F) / STEP_S)
    assert (durable["current_interval_steps"], durable["current_interval_s"]) == (20, pytest.approx(20 * STEP_S))
    # Memory: C = 0.25 s, the other 87.4% of failures; now every 10 steps.
    assert memory["tier_mtbf_s"] == pytest.approx(MTBF / (1 - F))
    assert memory["interval_s"] == pytest.approx(math.sqrt(2 * 0.25 * MTBF / (1 - F)))
    assert memory["interval_steps"] == round(math.sqrt(2 * 0.25 * MTBF / (1 - F)) / STEP_S) == 10
    assert memory["current_interval_steps"] == 10
    text = format_report(s)
    assert (
        f"memory-tier interval (Young-Daly sqrt(2 x cost x MTBF)): {math.sqrt(2 * 0.25 * MTBF / (1 - F)):.1f}s ="
        " every ~10 steps (now every 10); checkpoint cost to the loop 0.25s (median; 0.50s in all), MTBF 130.5s"
        " observed (2 failure(s)); 87.35% of failures resume from this tier (--durable-fraction), MTBF for it 149.4s"
    ) in text


def test_a_given_durable_fraction_sets_both_intervals():
    s = summarize(history("tiers"), durable_fraction=0.5)
    intervals = s["checkpoint_intervals"]
    assert intervals["durable"]["interval_s"] == pytest.approx(math.sqrt(2 * 2.0 * MTBF / 0.5))
    assert intervals["memory"]["interval_s"] == pytest.approx(math.sqrt(2 * 0.25 * MTBF / 0.5))
    assert (s["tiers"]["durable_fraction"], s["tiers"]["durable_fraction_source"]) == (0.5, "given")
    # Of this run's two failures, none resumed from the durable tier.
    assert s["tiers"]["observed_durable_fraction"] == {"durable": 0, "failures": 2}
    # All failures need the durable tier: the memory tier gets no interval.
    nothing = summarize(history("tiers"), durable_fraction=1.0)["checkpoint_intervals"]["memory"]
    assert (nothing["tier_mtbf_s"], nothing["interval_s"]) == (None, None)
    assert "no failure resumes from this tier, no suggestion" in format_report(
        summarize(history("tiers"), durable_fraction=1.0)
    )


@pytest.mark.parametrize("fraction", [-0.1, 1.5, math.nan, "0.5", True])
def test_a_durable_fraction_outside_0_to_1_is_refused(fraction):
    with pytest.raises(ValueError, match=r"summarize\(durable_fraction=.*from 0 to 1"):
        summarize([], durable_fraction=fraction)


def test_the_tier_lines_of_the_report():
    text = format_report(summarize(history("tiers")))
    assert "attempt 0: world size 4, wall 70.5s, steps 0..50, productive 40.0s, 2 checkpoint(s) + 4 in memory," in text
    assert "resumed at step 40 from the peer tier, recomputed 10 steps (8.0s)" in text
    assert "resumed at step 60 from the local tier, recomputed 5 steps" in text
    lines = text.splitlines()
    start = lines.index("  checkpoint tiers:")
    assert lines[start + 1 : start + 8] == [
        "    durable saves: 3, stall 2.0s median (11.0s in all), 4.0 kB on rank 0",
        "    memory saves: 10, stall 0.25s median (0.50s in all), 1.0 kB + 1.0 kB peer on rank 0, 1 failed (/dev/shm"
        " full: 1)",
        "    restores from local: 1, load 0.50s median (ranks: 4 local); 5.0 steps lost per failure (1 failure(s): 5)",
        "    restores from peer: 1, load 1.0s median (ranks: 2 local, 2 peer); 10.0 steps lost per failure (1"
        " failure(s): 10)",
        "    restores from durable: 1, load 4.0s median",
        "    failures that resumed from the durable tier (or from nothing): 0 of 2; the intervals use 12.65% (assumed,"
        " --durable-fraction)",
        "    rejected checkpoints: 1 durable, 1 local",
    ]


def test_a_log_without_tiers_reads_as_durable_and_as_before():
    s = summarize(history("hung"))
    tiers = s["tiers"]
    assert tiers["memory_in_use"] is False
    assert (tiers["saves"]["durable"]["count"], tiers["saves"]["memory"]["count"]) == (1, 0)
    assert (tiers["restores"]["durable"]["attempts"], tiers["restores"]["durable"]["lost_steps"]) == (1, [7])
    assert s["checkpoint_intervals"]["memory"] is None
    # The durable tier recovers every failure: the interval is 0.2.0's.
    assert s["checkpoint_interval"]["failure_share"] == 1.0
    assert s["checkpoint_interval"]["interval_s"] == pytest.approx(math.sqrt(2 * 0.5 * 161.0))
    text = format_report(s)
    assert 'memory tier: not in use (no save, failed save or resume names tier "memory")' in text
    assert "from the durable tier" not in text and "resume from this tier" not in text
    # Naming the tier on every checkpoint line changes nothing.
    named = [
        e | {"tier": "durable"} if e["event"] in ("checkpoint_committed", "resumed", "checkpoint_rejected") else e
        for e in history("hung")
    ]
    assert format_report(summarize(named)) == text


def test_a_restart_without_a_checkpoint_is_listed_as_resumed_from_nothing():
    events = [e for e in history("tiers") if not (e["event"] == "resumed" and e["attempt"] == 2)]
    restores = summarize(events)["tiers"]["restores"]
    # Attempt 1 reached step 65; attempt 2 then started from step 0.
    assert restores["none"]["failures"] == 1 and restores["none"]["lost_steps"] == [65]
    assert restores["local"]["attempts"] == 0
