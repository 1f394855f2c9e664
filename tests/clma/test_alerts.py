"""Alerts (combined error bars, versioned baselines), bound re-derivation, region merges."""

import json
import math

import numpy as np
import pytest

from clma.privacy.mechanisms import NoiseSource
from clma.release import (
    AggregatedMetric,
    AlertBaselines,
    AlertRule,
    BoundsVersion,
    MetricSpec,
    RegionMergeTracker,
    evaluation_due,
    exceeds_combined_error_bars,
    merged_regional_report,
    minimum_detectable_shift,
    propose_clip_bound,
    update_bounds,
)

ACC = MetricSpec("accuracy", 0.0, 1.0)


def _metric(value, n=120, name="accuracy"):
    return AggregatedMetric(
        name=name, value=value, error_bar=math.log(20) / n, contributors=n, epsilon=1.0,
        noise_scale=1.0, sensitivity=1.0, clip_low=0.0, clip_high=1.0, min_cohort=50,
        noise_source=NoiseSource.SEEDED_SIMULATION,
    )


def _run(rule, baselines, region_values, *, pv="p1", bv="accuracy@v1", rnd=0):
    report = {r: _metric(v) for r, v in region_values.items()}
    return rule.evaluate(report, baselines, partition_version=pv, bounds_version=bv, round=rnd)


def test_within_bar_movement_is_quiet_and_twice_the_bar_fires():
    rule, base = AlertRule(metric="accuracy"), AlertBaselines()
    first = _run(rule, base, {"north": 0.80, "south": 0.70})
    assert first.alerts == [] and first.new_baselines == {"north": "first", "south": "first"}
    bar = _metric(0.8).published_error_bar  # same band -> same published bar
    combined = 2 * bar
    quiet = _run(rule, base, {"north": 0.80 - 0.9 * combined, "south": 0.70 + 0.5 * combined},
                 rnd=1)
    assert quiet.alerts == [] and sorted(quiet.quiet) == ["north", "south"]
    fired = _run(rule, base, {"north": 0.80 - 2 * combined, "south": 0.70}, rnd=2)
    assert [a.region for a in fired.alerts] == ["north"]
    alert = fired.alerts[0]
    assert alert.combined_error_bar == pytest.approx(combined)
    assert alert.change == pytest.approx(-2 * combined) and alert.baseline_round == 0


def test_direction_filter():
    rule, base = AlertRule(metric="accuracy", direction="decrease"), AlertBaselines()
    _run(rule, base, {"r": 0.5})
    bar = 2 * _metric(0.5).published_error_bar
    assert _run(rule, base, {"r": 0.5 + 3 * bar}).alerts == []
    assert len(_run(rule, base, {"r": 0.5 - 3 * bar}).alerts) == 1


def test_partition_or_bounds_change_starts_new_baseline():
    rule, base = AlertRule(metric="accuracy"), AlertBaselines()
    _run(rule, base, {"r": 0.9})
    big = {"r": 0.3}
    ev = _run(rule, base, big, pv="p2")
    assert ev.alerts == [] and ev.new_baselines == {"r": "partition_changed"}
    ev = _run(rule, base, {"r": 0.9}, pv="p2", bv="accuracy@v2")
    assert ev.alerts == [] and ev.new_baselines == {"r": "bounds_changed"}
    # the new baseline is what later rounds compare against
    assert len(_run(rule, base, {"r": 0.3}, pv="p2", bv="accuracy@v2").alerts) == 1


def test_baselines_round_trip_json():
    rule, base = AlertRule(metric="accuracy"), AlertBaselines()
    _run(rule, base, {"a": 0.4, "b": 0.6})
    restored = AlertBaselines.from_dict(json.loads(json.dumps(base.to_dict())))
    assert restored == base
    assert "contributors" not in json.dumps(base.to_dict())


def test_false_alert_rate_from_noise_alone_is_small():
    """Same true mean, fresh noise each round: alerts are rare (<= 10 % by union bound)."""
    from clma.release import aggregate_metric

    rng = np.random.default_rng(0)
    rule, base = AlertRule(metric="accuracy"), AlertBaselines()
    vals = rng.uniform(0, 1, 150)
    fired = 0
    for rnd in range(400):
        m = aggregate_metric(vals, ACC, epsilon=0.5, seed=rng)
        ev = rule.evaluate({"r": m}, base, partition_version="p", bounds_version="v", round=rnd)
        fired += len(ev.alerts)
    assert fired / 399 < 0.02


def test_combined_bars_helper_and_cadence():
    assert exceeds_combined_error_bars(1.0, 0.1, 1.25, 0.1)
    assert not exceeds_combined_error_bars(1.0, 0.1, 1.2, 0.1)
    with pytest.raises(ValueError, match="error bars"):
        exceeds_combined_error_bars(1.0, -0.1, 1.0, 0.1)
    assert [r for r in range(10) if evaluation_due(r, 3)] == [0, 3, 6, 9]
    # detectable shift shrinks as 1/k for a fixed total budget
    s1 = minimum_detectable_shift(sensitivity=1, total_epsilon=10, rounds=60, every_k_rounds=1, n=100)
    s4 = minimum_detectable_shift(sensitivity=1, total_epsilon=10, rounds=60, every_k_rounds=4, n=100)
    assert s1 == pytest.approx(2 * 6.0 * math.log(20) / 100) and s1 / s4 == pytest.approx(4.0)


# --- bounds --------------------------------------------------------------

EDGES = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def test_bound_from_published_histogram():
    noisy = [0.50, 0.20, 0.15, 0.08, 0.04, -0.01, 0.02]  # noisy fractions, one negative
    prop = propose_clip_bound(noisy, EDGES, target_fraction=0.95)
    # clamped mass 0.99: cumulative 0.505, 0.707, 0.859, 0.939, 0.980 -> bucket 4 (<= 2.0)
    assert prop.clip_high == 2.0 and prop.bucket == 4 and not prop.saturated
    assert prop.cumulative_fraction == pytest.approx(0.97 / 0.99)
    sat = propose_clip_bound([0.1, 0, 0, 0, 0, 0, 0.9], EDGES)
    assert sat.saturated and sat.clip_high == 8.0
    with pytest.raises(ValueError, match="one more entry"):
        propose_clip_bound([0.1, 0.2], EDGES)


def test_bound_change_is_versioned():
    v1 = BoundsVersion(metric="mean_loss", clip_low=0.0, clip_high=4.0, version=1)
    same = update_bounds(v1, propose_clip_bound([0, 0, 0, 0, 0.3, 0.68, 0.02], EDGES), round=3)
    assert same == v1  # proposal 4.0: no change, no new version
    v2 = update_bounds(v1, propose_clip_bound([0.6, 0.3, 0.05, 0.05, 0, 0, 0], EDGES), round=7)
    assert v2.version == 2 and v2.clip_high == 0.5 and v2.derived_at_round == 7
    assert v2.label == "mean_loss@v2" and v2.spec().sensitivity == 0.5
    with pytest.raises(ValueError, match="finite"):
        BoundsVersion(metric="m", clip_low=0, clip_high=math.inf, version=1)


# --- region merge rule ---------------------------------------------------

def test_region_merged_after_consecutive_below_floor_evaluations():
    tracker = RegionMergeTracker(neighbours={"islands": "coast", "coast": "north",
                                             "north": "coast"}, consecutive_required=2)
    rng = np.random.default_rng(0)
    data = {"islands": rng.uniform(0, 1, 20), "coast": rng.uniform(0, 1, 70),
            "north": rng.uniform(0, 1, 90)}
    rep1 = merged_regional_report(data, ACC, tracker, epsilon_total=1.0, seed=1)
    assert set(rep1) == {"coast", "north"} and rep1.merged_regions == {}
    assert tracker.streaks["islands"] == 1 and tracker.merged == {}
    # a publishable evaluation in between resets the streak
    tracker.observe(list(data), [])
    assert tracker.streaks["islands"] == 0
    merged_regional_report(data, ACC, tracker, epsilon_total=1.0, seed=2)
    merged_regional_report(data, ACC, tracker, epsilon_total=1.0, seed=3)
    assert tracker.merged == {"islands": "coast"}
    rep = merged_regional_report(data, ACC, tracker, epsilon_total=1.0, seed=4)
    assert set(rep) == {"coast+islands", "north"}
    assert rep["coast+islands"].contributors == 90  # members' clients, each once
    assert rep["coast+islands"].epsilon == 1.0  # still parallel composition
    pub = rep.to_published_dict()
    assert pub["merged_regions"] == {"coast+islands": ["coast", "islands"]}
    assert "finest granularity" in pub["granularity_note"]
    assert tracker.monitoring_version("p1") != "p1"
    assert RegionMergeTracker.from_dict(json.loads(json.dumps(tracker.to_dict()))) == tracker


def test_merge_needs_a_named_neighbour():
    tracker = RegionMergeTracker(neighbours={}, consecutive_required=1)
    with pytest.raises(ValueError, match="no neighbour"):
        tracker.observe(["lonely"], ["lonely"])


def test_bounds_rederived_from_released_histogram_end_to_end():
    """Device histograms -> clipped sum -> one Laplace release -> proposed bound."""
    from clma.metrics import error_histogram
    from clma.release import aggregate_vector_sum

    rng = np.random.default_rng(5)
    # per-example losses mostly below 1.0; 3 % of mass in (2, 4]
    hists = [error_histogram(np.concatenate([rng.uniform(0, 0.9, 97), rng.uniform(2.1, 3.9, 3)]),
                             EDGES) for _ in range(400)]
    rel = aggregate_vector_sum(np.sum(hists, axis=0), 400, name="error_histogram",
                               l1_sensitivity=2.0, epsilon=1.0, seed=1)
    assert rel.noise_scale == 2.0 and rel.error_bar == pytest.approx(2 * math.log(20) / 400)
    assert "contributors" not in rel.to_published_dict()
    prop = propose_clip_bound(rel.to_published_dict()["values"], EDGES, target_fraction=0.95)
    assert prop.clip_high == 1.0 and not prop.saturated
    prop99 = propose_clip_bound(rel.values, EDGES, target_fraction=0.99)
    assert prop99.clip_high == 4.0
