from __future__ import annotations

import math
import random
import statistics

import pytest

from lightning_ft.monitors.straggler_detector import DetectorConfig, StragglerDetector, medians_of_others


def _feed(detector: StragglerDetector, windows: list[list[float]], steps: int = 10) -> list:
    found = []
    for w, own in enumerate(windows):
        found += detector.update(own, step=(w + 1) * steps, steps=steps).detections
    return found


def test_a_rank_20_percent_slower_is_named_after_patience_windows():
    detector = StragglerDetector(DetectorConfig(patience=3))
    healthy = [[100.0] * 8 for _ in range(5)]
    slow = [[100.0] * 8 for _ in range(3)]
    for w in slow:
        w[5] = 120.0
    found = _feed(detector, healthy + slow)
    assert [(d.rank, d.kind) for d in found] == [(5, "fleet")]
    assert found[0].ratio == pytest.approx(1.2)
    assert found[0].onset_step == 51  # first step of the first slow window


def test_a_slow_rank_is_named_once_per_episode():
    detector = StragglerDetector(DetectorConfig(patience=2))
    windows = [[100.0, 130.0, 100.0] for _ in range(10)]
    assert len(_feed(detector, windows)) == 1


def test_one_window_under_the_threshold_delays_a_detection_by_one_window_only():
    detector = StragglerDetector(DetectorConfig(patience=3))
    windows = [[100.0, 100.0, 100.0, 100.0]] * 2 + [[100.0, 100.0, 100.0, 125.0]] * 2
    windows += [[100.0, 100.0, 100.0, 110.0], [100.0, 100.0, 100.0, 125.0]]
    found = _feed(detector, windows)
    assert [(d.rank, d.step, d.onset_step) for d in found] == [(3, 60, 21)]


def test_with_two_ranks_the_slow_one_is_compared_with_the_other():
    detector = StragglerDetector(DetectorConfig(patience=2))
    found = _feed(detector, [[100.0, 120.0]] * 3)
    assert [d.rank for d in found] == [1]
    assert found[0].ratio == pytest.approx(1.2)


def test_a_one_window_stall_on_one_rank_is_not_named():
    detector = StragglerDetector(DetectorConfig(patience=3))
    windows = [[100.0] * 4 for _ in range(10)]
    windows[4] = [100.0, 100.0, 400.0, 100.0]
    assert _feed(detector, windows) == []


def test_a_slowdown_of_the_whole_fleet_names_nobody():
    detector = StragglerDetector(DetectorConfig(patience=2))
    windows = [[100.0] * 6] * 4 + [[180.0] * 6] * 6
    assert _feed(detector, windows) == []


def test_a_rank_that_drifts_from_its_own_baseline_is_named_as_drift():
    # Rank 2 starts 10% faster than the others, then becomes 10% slower: never 12% above the fleet, but 22% above
    # its own baseline.
    detector = StragglerDetector(DetectorConfig(patience=2, threshold=0.12, drift_threshold=0.2))
    windows = [[100.0, 100.0, 90.0, 100.0]] * 4 + [[100.0, 100.0, 110.0, 100.0]] * 3
    found = _feed(detector, windows)
    assert [(d.rank, d.kind) for d in found] == [(2, "drift")]


def test_a_recovered_rank_reports_the_time_the_fleet_lost_to_it():
    detector = StragglerDetector(DetectorConfig(patience=1))
    detector.update([10.0, 10.0, 30.0], step=10, steps=10)
    result = detector.update([10.0, 10.0, 10.0], step=20, steps=10)
    # 20 ms over the others for 10 steps.
    assert [(r.rank, r.lost_s) for r in result.recoveries] == [(2, pytest.approx(0.2))]
    assert detector.named == {}


def test_ranks_that_report_nothing_are_ignored():
    detector = StragglerDetector(DetectorConfig(patience=1))
    result = detector.update([10.0, math.nan, 10.0, 30.0], step=10, steps=10)
    assert [d.rank for d in result.detections] == [3]
    assert math.isnan(result.ratios[1])


def test_medians_of_others_match_a_direct_computation():
    rng = random.Random(0)
    for n in (2, 3, 4, 7, 8):
        values = [rng.uniform(0, 10) for _ in range(n)]
        expected = [statistics.median(values[:i] + values[i + 1 :]) for i in range(n)]
        assert medians_of_others(values) == pytest.approx(expected)


@pytest.mark.parametrize(
    "kwargs",
    [{"threshold": 0}, {"patience": 0}, {"min_excess_ms": -1}, {"drift_threshold": 0}, {"baseline_windows": 0}],
)
def test_config_rejects_out_of_range_values_naming_the_option(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        DetectorConfig(**kwargs)
