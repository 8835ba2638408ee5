"""The goodput projection: the failure rate read off published points, and the ETTR at scale with and without the
memory tier from a run's own costs (``histories/tiers``, described in test_checkpoint_tiers.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_ft.events import read_events
from lightning_ft.monitors.goodput_projection import DEFAULT_MTTF_HOURS_AT, mttf_hours
from lightning_ft.monitors.goodput_report import summarize
from lightning_ft.monitors.goodput_text import format_report

HISTORIES = Path(__file__).parent / "histories"
F = 53 / 419
# The costs measured in histories/tiers. Durable: save stall median(1, 3, 2) s; the one durable resume took
# rendezvous 15 + start-up 6 + load 4 + first step 3 s. Memory: stall 0.25 s; the peer and the local resume took
# median(20, 10) + median(6, 6) + median(1, 0.5) + median(3, 2.5) s.
C_D, R_D = 2.0, 15 + 6 + 4 + 3
C_M, R_M = 0.25, 15 + 6 + 0.75 + 2.75


def history(name: str) -> list[dict]:
    return read_events(HISTORIES / name)


def test_the_mttf_is_read_off_the_published_points_on_log_log_axes():
    assert DEFAULT_MTTF_HOURS_AT == {1024: 7.9, 16384: 1.8}
    assert mttf_hours(1024, DEFAULT_MTTF_HOURS_AT) == (7.9, "given")
    assert mttf_hours(16384, DEFAULT_MTTF_HOURS_AT) == (1.8, "given")
    # 4096 is halfway between 1024 and 16384 on a log axis: the geometric mean of the two MTTFs.
    hours, how = mttf_hours(4096, DEFAULT_MTTF_HOURS_AT)
    assert (hours, how) == (pytest.approx(math.sqrt(7.9 * 1.8)), "interpolated")
    # Beyond the points, the end segment's slope: ln(1.8 / 7.9) / ln(16) per e-fold of GPUs.
    slope = math.log(1.8 / 7.9) / math.log(16)
    assert mttf_hours(65536, DEFAULT_MTTF_HOURS_AT) == (pytest.approx(1.8 * 4**slope), "extrapolated")
    assert mttf_hours(256, DEFAULT_MTTF_HOURS_AT) == (pytest.approx(7.9 * 0.25**slope), "extrapolated")
    # One point alone: failures independent per GPU, MTTF as 1/N.
    assert mttf_hours(2048, {1024: 8.0}) == (4.0, "scaled as 1/N")
    # Three points: the segment around N.
    assert mttf_hours(2048, {1024: 8.0, 4096: 2.0, 16384: 1.0})[0] == pytest.approx(4.0)
    assert mttf_hours(8192, {1024: 8.0, 4096: 2.0, 16384: 1.0})[0] == pytest.approx(math.sqrt(2.0))


def _without(mttf_s: float) -> float:
    tau = math.sqrt(2 * C_D * mttf_s)
    return 1 - (C_D / tau + tau / (2 * mttf_s) + R_D / mttf_s)


def _with(mttf_s: float, f: float) -> float:
    tau_m, tau_d = math.sqrt(2 * C_M * mttf_s / (1 - f)), math.sqrt(2 * C_D * mttf_s / f)
    save = C_M / tau_m + C_D / tau_d
    lost = ((1 - f) * tau_m / 2 + f * tau_d / 2) / mttf_s
    return 1 - (save + lost + ((1 - f) * R_M + f * R_D) / mttf_s)


def test_the_projection_uses_the_run_s_own_costs_per_tier():
    p = summarize(history("tiers"), project_gpus=[1024, 4096, 16384])["projection"]
    assert (p["durable"]["stall_s"], p["durable"]["restart_s"]) == (C_D, R_D)
    assert p["durable"]["parts"] == {"rendezvous_s": 15.0, "startup_s": 6.0, "load_s": 4.0, "first_step_s": 3.0}
    assert (p["memory"]["stall_s"], p["memory"]["restart_s"]) == (pytest.approx(C_M), pytest.approx(R_M))
    assert (p["durable_fraction"], p["memory_note"], p["note"]) == (pytest.approx(F), None, None)
    for row, hours in zip(p["rows"], (7.9, math.sqrt(7.9 * 1.8), 1.8), strict=True):
        mttf_s = hours * 3600
        assert row["mttf_s"] == pytest.approx(mttf_s)
        assert row["without"]["ettr"] == pytest.approx(_without(mttf_s))
        assert row["with"]["ettr"] == pytest.approx(_with(mttf_s, F))
        assert row["with"]["interval_s"] == {
            "memory": pytest.approx(math.sqrt(2 * C_M * mttf_s / (1 - F))),
            "durable": pytest.approx(math.sqrt(2 * C_D * mttf_s / F)),
        }
    # At 16384 GPUs: 97.08% without, 97.91% with.
    text = format_report(summarize(history("tiers"), project_gpus=[16384]))
    assert (
        f"    16384 GPUs (MTTF 1.8h, given): without the memory tier {100 * _without(6480):.2f}% (durable every"
        f" {math.sqrt(2 * C_D * 6480):.1f}s); with it {100 * _with(6480, F):.2f}% (memory every"
        f" {math.sqrt(2 * C_M * 6480 / (1 - F)):.1f}s, durable every {math.sqrt(2 * C_D * 6480 / F):.1f}s)"
    ) in text
    assert "97.08%" in text and "97.91%" in text
    assert "(rendezvous 15.0s, start-up 6.0s, load 4.0s, first step 3.0s)" in text
    assert "arXiv 2410.21680" in text and "arXiv 2407.21783" in text


def test_given_failure_rates_and_durable_share_replace_the_defaults():
    p = summarize(history("tiers"), project_gpus=[2000], mttf_hours_at={1000: 10.0, 4000: 2.5}, durable_fraction=0.5)[
        "projection"
    ]
    (row,) = p["rows"]
    # Slope ln(2.5 / 10) / ln(4) = -1: 2000 GPUs fail every 5 h.
    assert (row["mttf_s"], row["mttf_how"]) == (pytest.approx(5 * 3600), "interpolated")
    assert row["with"]["ettr"] == pytest.approx(_with(5 * 3600, 0.5))
    assert (p["mttf_source"], p["durable_fraction_source"]) == ("given (--mttf-hours-at)", "given (--durable-fraction)")
    # Every failure needs the durable tier: the memory tier's best interval is never, and it changes nothing.
    row = summarize(history("tiers"), project_gpus=[1024], durable_fraction=1.0)["projection"]["rows"][0]
    mttf_s = 7.9 * 3600
    assert row["with"]["ettr"] == pytest.approx(_without(mttf_s))
    assert row["with"]["interval_s"]["memory"] is None


def test_without_memory_tier_data_the_with_column_is_omitted_and_says_why():
    s = summarize(history("hung"), project_gpus=[1024])
    p = s["projection"]
    assert p["memory"] is None and p["rows"][0]["with"] is None
    # hung: C = 0.5 s; its resume lacks rendezvous and first step, taken from the restart: relaunch 18 s, first step
    # 5.5 s; start-up 12 s, load 2.5 s from the resumed event.
    assert p["durable"]["restart_s"] == 18 + 12 + 2.5 + 5.5
    assert p["rows"][0]["without"]["ettr"] == pytest.approx(1 - (math.sqrt(2 * 0.5 / (7.9 * 3600)) + 38 / (7.9 * 3600)))
    text = format_report(s)
    assert (
        'with the memory tier: omitted: this run recorded no memory-tier save (checkpoint_committed with tier "memory"'
        in text
    )
    assert "; with it" not in text


def test_memory_saves_without_a_memory_resume_assume_the_durable_restart_cost_and_say_so():
    events = [e for e in history("tiers") if not (e["event"] == "resumed" and e.get("tier") in ("local", "peer"))]
    p = summarize(events, project_gpus=[1024])["projection"]
    assert (p["memory"]["stall_s"], p["memory"]["restart_s"], p["memory"]["restart_assumed"]) == (
        pytest.approx(C_M),
        R_D,
        True,
    )
    assert "assumed to cost what one from the durable tier did" in p["memory_note"]
    assert "with the memory tier: a restart from the memory tier is assumed" in format_report(
        summarize(events, project_gpus=[1024])
    )


def test_no_periodic_durable_save_means_nothing_to_project():
    events = [e for e in history("hung") if e["event"] != "checkpoint_committed"]
    p = summarize(events, project_gpus=[1024])["projection"]
    assert p["rows"] == [] and "no periodic durable checkpoint" in p["note"]
    assert summarize(history("hung"))["projection"] is None


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"project_gpus": []}, "project_gpus"),
        ({"project_gpus": [1024, 0]}, "project_gpus"),
        ({"project_gpus": [1.5]}, "project_gpus"),
        ({"project_gpus": [1024], "mttf_hours_at": {}}, "mttf_hours_at"),
        ({"project_gpus": [1024], "mttf_hours_at": {1024: -1.0}}, "mttf_hours_at"),
        ({"project_gpus": [1024], "mttf_hours_at": {1024: math.inf}}, "mttf_hours_at"),
    ],
)
def test_bad_projection_options_are_refused_before_any_work(kwargs, option):
    with pytest.raises(ValueError, match=rf"summarize\({option}="):
        summarize([], **kwargs)
