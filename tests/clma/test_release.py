"""Releases: spec validation, noise once on the sum, exact error bars, cohort floor."""

import json
import math

import numpy as np
import pytest
from scipy import stats

from clma.privacy.mechanisms import NoiseSource, PrivacyParameterError
from clma.release import (
    AggregatedMetric,
    BelowCohortFloor,
    MetricSpec,
    ParticipantBand,
    SuppressedRegionBand,
    aggregate_metric,
    aggregate_sum,
    participant_band,
    region_seed,
    regional_report,
    suppressed_region_band,
)

ACC = MetricSpec("accuracy", 0.0, 1.0)
LOSS = MetricSpec(name="mean_loss", clip_low=0.0, clip_high=5.0)


# --- MetricSpec -------------------------------------------------------------

@pytest.mark.parametrize(
    "low,high,field",
    [(0.0, math.inf, "clip_high"), (-math.inf, 1.0, "clip_low"), (math.nan, 1.0, "clip_low"),
     (0.0, math.nan, "clip_high")],
)
def test_spec_rejects_non_finite_bounds(low, high, field):
    with pytest.raises(ValueError, match=f"(?s){field}.*finite"):
        MetricSpec("m", low, high)


@pytest.mark.parametrize("low,high", [(1.0, 0.0), (2.0, 2.0)])
def test_spec_rejects_non_increasing_bounds(low, high):
    with pytest.raises(ValueError, match="clip_high must be strictly greater than clip_low"):
        MetricSpec("m", low, high)


def test_spec_sensitivity_and_clip():
    spec = MetricSpec("m", -1.0, 3.0)
    assert spec.sensitivity == 4.0
    np.testing.assert_array_equal(spec.clip([[-5.0, 0.5], [3.5, 1e6]]), [[-1.0, 0.5], [3.0, 3.0]])
    with pytest.raises(ValueError, match="NaN"):
        spec.clip([0.0, math.nan])
    with pytest.raises(ValueError):  # frozen
        spec.clip_low = 0.0  # type: ignore[misc]


# --- aggregate_metric -------------------------------------------------------

def test_value_is_noisy_clipped_sum_over_n_with_noise_once():
    rng = np.random.default_rng(0)
    values = rng.uniform(-1, 2, size=80)
    m = aggregate_metric(values, ACC, epsilon=0.5, seed=42)
    # reproduce the single draw: noise of scale b = 1/0.5 on the clipped sum
    noise = np.random.default_rng(42).laplace(0.0, 2.0)
    assert m.value == pytest.approx((np.clip(values, 0, 1).sum() + noise) / 80, rel=1e-12)
    assert m.error_bar == pytest.approx(2.0 * math.log(20.0) / 80, rel=1e-14)
    assert m.contributors == 80 and m.noise_source is NoiseSource.SEEDED_SIMULATION
    assert m.noise_scale == 2.0 and m.sensitivity == 1.0


def test_outlier_client_moves_mean_by_at_most_clip_range_over_n():
    rng = np.random.default_rng(1)
    n = 120
    values = rng.uniform(0, 5, size=n)
    base = aggregate_metric(values, LOSS, epsilon=1.0, seed=7)
    for i in range(5):
        attacked = values.copy()
        attacked[i] = 1e6
        moved = aggregate_metric(attacked, LOSS, epsilon=1.0, seed=7)
        shift = abs(moved.value - base.value)
        assert shift <= LOSS.sensitivity / n + 1e-12
        assert shift == pytest.approx((5.0 - values[i]) / n, rel=1e-9)


def test_below_floor_is_suppressed_before_any_noise():
    with pytest.raises(BelowCohortFloor, match="cohort floor"):
        aggregate_metric(np.ones(49), ACC, epsilon=1.0, min_cohort=50, seed=0)
    assert aggregate_metric(np.ones(50), ACC, epsilon=1.0, min_cohort=50, seed=0).contributors == 50
    assert issubclass(BelowCohortFloor, ValueError)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="1-D"):
        aggregate_metric(np.ones((60, 2)), ACC, epsilon=1.0)
    with pytest.raises(PrivacyParameterError, match="epsilon"):
        aggregate_metric(np.ones(60), ACC, epsilon=0.0)
    with pytest.raises(ValueError, match="min_cohort"):
        aggregate_metric(np.ones(60), ACC, epsilon=1.0, min_cohort=0)
    with pytest.raises(ValueError, match="clipped_sum") as info:
        aggregate_sum(1234.5, 60, ACC, epsilon=1.0)
    assert "1234" not in str(info.value)  # private values are not echoed
    with pytest.raises(TypeError, match="spec"):
        aggregate_metric(np.ones(60), {"name": "x"}, epsilon=1.0)


def _leaves(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def _release_values(release, n, draws, rng):
    values = np.full(n, 0.5)
    return np.array([release(values, rng) for _ in range(draws)])


def _correct(values, rng):
    return aggregate_metric(values, ACC, epsilon=1.0, min_cohort=10, seed=rng).value


def _per_client_noise(values, rng):
    """Deliberately wrong: each client noises its own value (local DP)."""
    b = ACC.sensitivity / 1.0
    return float(np.mean(ACC.clip(values) + rng.laplace(0.0, b, size=values.size)))


def _variance_matches_central(samples, n, b=1.0):
    """Var(value) should be 2 b^2 / n^2; 5 % tolerance (sd of ratio ~1.4 % at 40k)."""
    return abs(np.var(samples) / (2 * b * b / n**2) - 1.0) < 0.05


def test_per_client_noise_is_detected():
    rng = np.random.default_rng(5)
    n = 25
    good = _release_values(_correct, n, 40_000, rng)
    assert _variance_matches_central(good, n)
    bad = _release_values(_per_client_noise, n, 4_000, rng)
    assert not _variance_matches_central(bad, n)


def test_empirical_noise_std_matches_theory_opendp():
    # seed=None -> OpenDP; 2000 releases at n=50, std of value = sqrt(2) b / n
    n, eps = 50, 2.0
    vals = np.array([aggregate_metric(np.full(n, 0.25), ACC, epsilon=eps, min_cohort=50).value
                     for _ in range(2000)])
    assert np.std(vals - 0.25) == pytest.approx(math.sqrt(2) * (1 / eps) / n, rel=0.08)
    assert stats.kstest((vals - 0.25) * n, stats.laplace(scale=1 / eps).cdf).pvalue > 1e-3


def test_laplace_error_bar_coverage_is_95_and_normal_approx_is_lower():
    rng = np.random.default_rng(9)
    n, draws = 100, 20_000
    values = rng.uniform(0, 1, size=n)
    truth = values.mean()
    errors, bar = [], None
    for _ in range(draws):
        m = aggregate_metric(values, ACC, epsilon=1.0, min_cohort=50, seed=rng)
        errors.append(m.value - truth)
        bar = m.error_bar
    errors = np.abs(np.asarray(errors))
    tol = 4 * math.sqrt(0.95 * 0.05 / draws)
    assert np.mean(errors <= bar) == pytest.approx(0.95, abs=tol)
    normal_bar = 1.96 * math.sqrt(2) * 1.0 / n
    cov_normal = np.mean(errors <= normal_bar)
    assert cov_normal == pytest.approx(0.9375, abs=tol)
    assert cov_normal < 0.95 - tol


def test_gaussian_release_coverage_and_scale():
    rng = np.random.default_rng(10)
    n = 60
    vals = np.array([aggregate_metric(np.zeros(n), ACC, epsilon=1.0, delta=1e-5,
                                      mechanism="gaussian", seed=rng).value
                     for _ in range(10_000)])
    m = aggregate_metric(np.zeros(n), ACC, epsilon=1.0, delta=1e-5, mechanism="gaussian", seed=0)
    assert np.std(vals) == pytest.approx(m.noise_scale / n, rel=0.05)
    assert np.mean(np.abs(vals) <= m.error_bar) == pytest.approx(0.95, abs=0.009)
    assert m.rho == pytest.approx(1.0 / (2 * m.noise_scale**2), rel=1e-12)
    with pytest.raises(PrivacyParameterError, match="delta"):
        aggregate_metric(np.zeros(n), ACC, epsilon=1.0, delta=1e-5)  # laplace takes no delta


def _loglog_slope(ns, bars):
    return float(np.polyfit(np.log(ns), np.log(bars), 1)[0])


def _shrinks_as_one_over_n(ns, bars):
    return abs(_loglog_slope(ns, bars) + 1.0) < 0.05


def test_error_bar_shrinks_as_one_over_n_and_sqrt_shape_fails():
    ns = np.array([50, 100, 200, 400, 800, 1600, 3200])
    bars = np.array([aggregate_metric(np.ones(n), ACC, epsilon=0.7, seed=0).error_bar for n in ns])
    assert _shrinks_as_one_over_n(ns, bars)
    assert not _shrinks_as_one_over_n(ns, bars[0] * np.sqrt(ns[0] / ns))
    # and empirically: the spread of the released value shrinks as 1/n too
    rng = np.random.default_rng(3)
    spread = [np.std([aggregate_metric(np.ones(n), ACC, epsilon=0.7, seed=rng).value
                      for _ in range(3000)]) for n in ns[:4]]
    assert abs(_loglog_slope(ns[:4], spread) + 1.0) < 0.08


# --- published view -------------------------------------------------------

def test_published_view_hides_exact_count():
    m = aggregate_metric(np.full(137, 0.5), ACC, epsilon=1.0, min_cohort=50, seed=1)
    pub = m.to_published_dict()
    leaves = list(_leaves(json.loads(json.dumps(pub))))
    assert "contributors" not in leaves
    assert not any(isinstance(v, (int, float)) and v == 137 for v in leaves)
    assert pub["participant_band"] == "double_to_under_fourfold"
    # bar from the band's lower edge (2 * 50), conservative
    assert pub["error_bar"] == pytest.approx(1.0 * math.log(20) / 100, rel=1e-14)
    assert m.published_error_bar > m.error_bar
    # any n in the same band publishes the same bar
    other = aggregate_metric(np.full(199, 0.5), ACC, epsilon=1.0, min_cohort=50, seed=1)
    assert other.published_error_bar == m.published_error_bar


def test_participant_bands():
    assert participant_band(50, 50) is ParticipantBand.MINIMUM_TO_UNDER_DOUBLE
    assert participant_band(99, 50) is ParticipantBand.MINIMUM_TO_UNDER_DOUBLE
    assert participant_band(100, 50) is ParticipantBand.DOUBLE_TO_UNDER_FOURFOLD
    assert participant_band(199, 50) is ParticipantBand.DOUBLE_TO_UNDER_FOURFOLD
    assert participant_band(200, 50) is ParticipantBand.FOURFOLD_OR_MORE
    with pytest.raises(BelowCohortFloor):
        participant_band(49, 50)


def test_is_significant_uses_combined_published_bars():
    def metric(value, n=100):
        return AggregatedMetric(
            name="accuracy", value=value, error_bar=math.log(20) / n, contributors=n,
            epsilon=1.0, noise_scale=1.0, sensitivity=1.0, clip_low=0.0, clip_high=1.0,
            min_cohort=50, noise_source=NoiseSource.SEEDED_SIMULATION,
        )

    a = metric(0.5)
    combined = 2 * a.published_error_bar
    assert not a.is_significant(metric(0.5 + 0.99 * combined))
    assert a.is_significant(metric(0.5 + 1.01 * combined))
    assert a.is_significant(metric(0.5 - 2 * combined))
    # exact bars are available server side
    assert a.is_significant(metric(0.5 + 1.01 * 2 * a.error_bar), published=False)
    with pytest.raises(ValueError, match="same metric"):
        a.is_significant(a.model_copy(update={"name": "loss"}))


# --- regional_report --------------------------------------------------------

def test_regional_report_never_publishes_below_floor():
    rng = np.random.default_rng(4)
    for trial in range(30):
        sizes = rng.integers(1, 200, size=6)
        by_region = {f"r{i}": rng.uniform(0, 1, s) for i, s in enumerate(sizes)}
        rep = regional_report(by_region, ACC, epsilon_total=1.0, min_cohort=50, seed=trial)
        assert set(rep) == {f"r{i}" for i, s in enumerate(sizes) if s >= 50}
        assert all(m.contributors >= 50 for m in rep.values())
        n_supp = int(np.sum(sizes < 50))
        assert rep.suppressed_band is suppressed_region_band(n_supp)
        assert len(rep.suppressed_regions) == n_supp


def test_regional_epsilon_is_full_not_divided():
    by_region = {f"r{i}": np.full(60 + 10 * i, 0.5) for i in range(5)}
    rep = regional_report(by_region, ACC, epsilon_total=0.8, min_cohort=50, seed=1)
    assert len(rep) == 5
    for m in rep.values():
        assert m.epsilon == 0.8
        assert m.noise_scale == pytest.approx(ACC.sensitivity / 0.8, rel=1e-15)
    assert rep.epsilon_charged == 0.8
    assert rep.to_published_dict()["epsilon_charged"] == 0.8
    empty = regional_report({"a": np.ones(3)}, ACC, epsilon_total=0.8, seed=1)
    assert len(empty) == 0 and empty.epsilon_charged == 0.0


def test_regional_seeds_are_deterministic_and_per_region():
    by_region = {"north": np.full(70, 0.3), "south": np.full(90, 0.6)}
    a = regional_report(by_region, ACC, epsilon_total=1.0, seed=123)
    b = regional_report(by_region, ACC, epsilon_total=1.0, seed=123)
    c = regional_report({"north": by_region["north"]}, ACC, epsilon_total=1.0, seed=123)
    assert a["north"].value == b["north"].value == c["north"].value
    assert a["north"].value != a["south"].value - 0.3  # different noise per region
    assert region_seed(123, "north") != region_seed(123, "south")
    assert region_seed(123, "north") != region_seed(124, "north")


def test_regional_report_published_dict_has_no_counts():
    by_region = {"a": np.full(61, 0.3), "b": np.full(7, 0.6), "c": np.full(333, 0.9)}
    pub = regional_report(by_region, ACC, epsilon_total=1.0, seed=2).to_published_dict()
    leaves = list(_leaves(json.loads(json.dumps(pub))))
    assert "contributors" not in leaves
    for n in (61, 333, 7):  # exact region counts
        assert not any(isinstance(v, (int, float)) and v == n for v in leaves)
    assert pub["suppressed_regions_band"] == SuppressedRegionBand.ONE_TO_TWO.value
    assert set(pub["regions"]) == {"a", "c"}


def test_suppressed_region_band_edges():
    got = [suppressed_region_band(k).value for k in range(8)]
    assert got == ["none", "1_to_2", "1_to_2", "3_to_5", "3_to_5", "3_to_5",
                   "6_or_more", "6_or_more"]
    with pytest.raises(ValueError, match="n_suppressed"):
        suppressed_region_band(-1)


def test_region_without_contributors_is_suppressed():
    rep = regional_report({"empty": [], "full": np.full(60, 0.5)}, ACC, epsilon_total=1.0, seed=0)
    assert set(rep) == {"full"} and rep.suppressed_regions == ("empty",)
