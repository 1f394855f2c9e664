"""The leading-component split test (clma/cohort/split.py) and its use by CLMACohorter."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats

from clma.cohort import CLMACohorter
from clma.cohort.split import cluster_index, leading_split_test, null_cluster_indices


def _brute_ci(z, m):
    """min over every subset A with m <= |A| <= n - m of the 2-means within SS / TSS."""
    n = len(z)
    tss = float(((z - z.mean()) ** 2).sum())
    best = np.inf
    for k in range(m, n - m + 1):
        for a in itertools.combinations(range(n), k):
            mask = np.zeros(n, bool)
            mask[list(a)] = True
            w = ((z[mask] - z[mask].mean()) ** 2).sum() + ((z[~mask] - z[~mask].mean()) ** 2).sum()
            best = min(best, w)
    return best / tss


@pytest.mark.parametrize("m", [1, 2, 3])
def test_cluster_index_equals_the_minimum_over_every_split(m):
    rng = np.random.default_rng(7)
    for _ in range(5):
        z = rng.standard_normal(9) * rng.uniform(0.5, 3)
        ci, labels = cluster_index(z, m)
        assert ci == pytest.approx(_brute_ci(z, m), rel=1e-12, abs=1e-15)
        # the labels realise it, and group 0 holds the smaller scores
        w = sum(((z[labels == g] - z[labels == g].mean()) ** 2).sum() for g in (0, 1))
        assert w / ((z - z.mean()) ** 2).sum() == pytest.approx(ci, rel=1e-12)
        assert z[labels == 0].max() <= z[labels == 1].min()
        assert min(np.bincount(labels)) >= m


def test_cluster_index_literal_values():
    ci, labels = cluster_index(np.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]), 1)
    assert ci == 0.0 and labels.tolist() == [0, 1, 0, 1, 0, 1]
    # [0, 1, 2, 3]: best split {0,1} | {2,3}: within 0.5 + 0.5 = 1, total 5
    assert cluster_index(np.arange(4.0), 1)[0] == pytest.approx(0.2)
    # a lone outlier: with m = 1 it is split off alone, with m = 2 it may not be
    z = np.array([0.0, 0.1, 0.2, 0.3, 10.0])
    assert np.bincount(cluster_index(z, 1)[1]).tolist() == [4, 1]
    assert min(np.bincount(cluster_index(z, 2)[1])) == 2
    assert cluster_index(np.full(6, 3.0), 1)[0] == 1.0


def _pc1_scores(x):
    c = x - x.mean(axis=0)
    u, s, _ = np.linalg.svd(c, full_matrices=False)
    return u[:, 0] * s[0]


def test_null_law_is_the_leading_component_law_under_isotropic_noise():
    """Module docs: under d_i = mu + sigma e_i the leading component's CI has the law of a
    centered normalised Gaussian vector's, whatever p, mu, sigma."""
    rng = np.random.default_rng(11)
    n, m = 20, 3
    obs = [cluster_index(_pc1_scores(5.0 + 0.3 * rng.standard_normal((n, 400))), m)[0]
           for _ in range(300)]
    null = null_cluster_indices(n, m)
    assert stats.ks_2samp(obs, null).pvalue > 0.01
    # and it is not the law of the leading component of *structured* data
    shifted = []
    for _ in range(100):
        x = rng.standard_normal((n, 400))
        x[: n // 2, 0] += 9.0
        shifted.append(cluster_index(_pc1_scores(x), m)[0])
    assert stats.ks_2samp(shifted, null).pvalue < 1e-6


def test_false_split_rate_under_the_null_is_alpha():
    rng = np.random.default_rng(3)
    alpha, trials = 0.05, 400
    hits = sum(leading_split_test(_pc1_scores(rng.standard_normal((24, 300))), alpha,
                                  min_size=4).significant for _ in range(trials))
    # binomial(400, 0.05): 99.9 % interval about [8, 35]
    assert 8 <= hits <= 35


def test_a_family_split_below_the_broken_stick_is_found():
    """Two families 15 + 15 apart along one direction, with p = 600 noise dimensions: the
    direction carries ~7 % of the variance (broken stick for 29 components: 13.7 %)."""
    rng = np.random.default_rng(5)
    n, p = 30, 600
    x = rng.standard_normal((n, p))
    x[:15, 0] += 9.0
    z = _pc1_scores(x)
    share = np.linalg.svd(x - x.mean(0), compute_uv=False) ** 2
    assert share[0] / share.sum() < sum(1 / k for k in range(1, 30)) / 29
    res = leading_split_test(z, alpha=0.01)
    assert res.significant and res.p_value == pytest.approx(1 / 1000)
    truth = np.r_[np.zeros(15), np.ones(15)]
    assert (res.labels == truth).all() or (res.labels == 1 - truth).all()
    # too few clients for two groups of min_size: never significant
    small = leading_split_test(z[:9], alpha=0.5, min_size=5)
    assert not small.significant and small.p_value == 1.0


@pytest.mark.parametrize(("kw", "match"), [
    ({"alpha": 0.0}, "alpha: must lie in"), ({"alpha": 1.0}, "alpha: must lie in"),
    ({"alpha": 0.1, "draws": 50}, "draws: must be an integer >= 99"),
    ({"alpha": 0.1, "min_size": 0}, "min_size: must be an integer >= 1"),
])
def test_bad_parameters_are_refused_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        leading_split_test(np.arange(12.0), **kw)


def test_non_finite_scores_are_refused():
    with pytest.raises(ValueError, match="scores: must be finite"):
        leading_split_test(np.array([0.0, np.nan] * 6), 0.1)


def _families(rng, n_each=15, p=800, shift=10.0):
    ref = rng.standard_normal(p).astype(np.float32)
    x = ref + rng.standard_normal((2 * n_each, p)).astype(np.float32)
    x[:n_each, 0] += shift
    return [f"c{i}" for i in range(2 * n_each)], x.astype(np.float32), ref


def test_cohorter_splits_along_the_leading_component_only_when_asked():
    ids, x, ref = _families(np.random.default_rng(9))
    off = CLMACohorter(components="broken_stick", direction_rule="none").cohort(ids, x, ref)
    assert off.n_cohorts == 1
    assert off.groups[0].reason == "no component above the broken stick"
    on = CLMACohorter(components="broken_stick", direction_rule="none",
                      leading_split_alpha=0.01).cohort(ids, x, ref)
    assert on.n_cohorts == 2
    assert on.groups[0].reason.startswith("leading component split")
    first = {on.assignments[c] for c in ids[:15]}
    second = {on.assignments[c] for c in ids[15:]}
    assert len(first) == len(second) == 1 and first != second


def test_cohorter_keeps_a_single_family_whole_under_the_split_test():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal(800).astype(np.float32)
    x = (ref + rng.standard_normal((30, 800))).astype(np.float32)
    res = CLMACohorter(components="broken_stick", direction_rule="none",
                       leading_split_alpha=0.01).cohort([f"c{i}" for i in range(30)], x, ref)
    assert res.n_cohorts == 1
    assert "leading split not significant (p = " in res.groups[0].reason


@pytest.mark.parametrize(("kw", "match"), [
    ({"leading_split_alpha": 1.0}, "leading_split_alpha: must be None or lie in"),
    ({"leading_split_alpha": 0.0}, "leading_split_alpha: must be None or lie in"),
    ({"leading_split_min_size": 0}, "leading_split_min_size: must be an integer"),
])
def test_cohorter_refuses_bad_split_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        CLMACohorter(**kw)


def _small_families(seed, shift, sizes=(2, 2), p=800):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(p).astype(np.float32)
    x = (ref + rng.standard_normal((sum(sizes), p))).astype(np.float32)
    x[:sizes[0], 0] += shift
    return [f"c{i}" for i in range(sum(sizes))], x, ref


@pytest.mark.parametrize("seed", range(5))
def test_two_families_of_two_sites_are_split_below_twice_the_minimum_size(seed):
    """Six sites, four drifted in two families of two: the group of four is tested with
    groups of max(2, 4 // 2) = 2 (a fixed minimum of 5 could never split it). Shift 40
    puts ~40 % of the variance on the family direction, below the broken stick for three
    components (61 %), so only the leading split can separate them."""
    ids, x, ref = _small_families(seed, 40.0)
    res = CLMACohorter(components="broken_stick", direction_rule="none",
                       leading_split_alpha=0.01).cohort(ids, x, ref)
    assert res.groups[0].reason.startswith("leading component split")
    a = res.assignments
    assert a["c0"] == a["c1"] != a["c2"] == a["c3"]
    # the same group under an explicit minimum of 1 is tested with groups of 1
    assert CLMACohorter(components="broken_stick", direction_rule="none",
                        leading_split_alpha=0.01, leading_split_min_size=1
                        )._split_min_size(4) == 1


@pytest.mark.parametrize(("n", "m"), [(2, 2), (3, 2), (4, 2), (5, 2), (6, 3), (8, 4),
                                      (9, 4), (10, 5), (30, 5)])
def test_the_split_minimum_is_half_the_group_between_two_and_the_parameter(n, m):
    assert CLMACohorter(leading_split_alpha=0.01)._split_min_size(n) == m


def test_a_lone_client_is_never_split_off_a_small_group():
    """One client 40 noise units from two others (a group of 3, below the broken stick): no
    split of 2 + 1 is tried, the p-value is 1."""
    ids, x, ref = _small_families(0, 40.0, sizes=(1, 2))
    res = CLMACohorter(components="broken_stick", direction_rule="none",
                       leading_split_alpha=0.01).cohort(ids, x, ref)
    assert res.n_cohorts == 1
    assert res.groups[0].reason.endswith("leading split not significant (p = 1.0000)")


@pytest.mark.parametrize(("n", "m"), [(6, 3), (8, 4)])
def test_false_split_rate_of_small_groups_under_the_null_is_alpha(n, m):
    rng = np.random.default_rng(n)
    alpha, trials = 0.05, 400
    hits = sum(leading_split_test(_pc1_scores(rng.standard_normal((n, 300))), alpha,
                                  min_size=m).significant for _ in range(trials))
    assert 8 <= hits <= 35  # binomial(400, 0.05): 99.9 % interval about [8, 35]


def _one_family_two_magnitudes(seed, w=20.0, p=800):
    """15 clients drifting along one direction, 10 by w and 5 by 2w, plus N(0, I_p) noise."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(p).astype(np.float32)
    c = np.r_[np.ones(10), 2.0 * np.ones(5)]
    x = ref + rng.standard_normal((15, p))
    x[:, 0] += c * w
    return [f"c{i}" for i in range(15)], x.astype(np.float32), ref


def _two_families_sharing_half(seed, a=15.0, s=15.0, p=800):
    """2 x 8 clients: a common drift a along e0, and s along e1 (family A) or e2 (B)."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(p).astype(np.float32)
    x = ref + rng.standard_normal((16, p))
    x[:, 0] += a
    x[:8, 1] += s
    x[8:, 2] += s
    return [f"c{i}" for i in range(16)], x.astype(np.float32), ref


def _ratio(reason):
    import re

    return float(re.search(r"across/within displacement cosine (-?[0-9.]+)", reason).group(1))


@pytest.mark.parametrize("seed", range(3))
def test_a_leading_split_of_one_family_by_magnitude_is_undone(seed):
    """Two magnitudes of one drift (failure mode 1 of docs/realistic_drift.md section 8):
    the leading split test finds them (p = 0.001), the family ratio undoes it. Theory for
    these clients: cosines within 400/1200 and 1600/2400, across 800/sqrt(1200 * 2400),
    ratio 0.471 / 0.394 = 1.196."""
    ids, x, ref = _one_family_two_magnitudes(seed)
    kw = {"components": "broken_stick", "direction_rule": "none", "leading_split_alpha": 0.01}
    split = CLMACohorter(**kw).cohort(ids, x, ref)
    assert split.n_cohorts == 2 and split.groups[0].reason.startswith("leading component split (")
    kept = CLMACohorter(**kw, leading_split_family_ratio=0.7).cohort(ids, x, ref)
    assert kept.n_cohorts == 1
    reason = kept.groups[0].reason
    assert reason.startswith("leading component split undone: one family (")
    assert _ratio(reason) == pytest.approx(1.196, abs=0.1)


@pytest.mark.parametrize("seed", range(3))
def test_two_families_sharing_half_their_drift_stay_split(seed):
    """Cosines within (a^2 + s^2) / (a^2 + s^2 + p) = 0.36, across a^2 / (...) = 0.18:
    ratio 0.5, the covariate families' (0.43-0.53), below 0.7: the split stands."""
    ids, x, ref = _two_families_sharing_half(seed)
    res = CLMACohorter(components="broken_stick", direction_rule="none",
                       leading_split_alpha=0.01, leading_split_family_ratio=0.7
                       ).cohort(ids, x, ref)
    assert res.n_cohorts == 2
    assert _ratio(res.groups[0].reason) == pytest.approx(0.5, abs=0.1)
    first = {res.assignments[c] for c in ids[:8]}
    assert len(first) == 1 and first.isdisjoint({res.assignments[c] for c in ids[8:]})


@pytest.mark.parametrize("value", [0.0, 1.5, float("nan"), -0.2])
def test_the_family_ratio_is_refused_outside_its_range(value):
    with pytest.raises(ValueError, match=r"leading_split_family_ratio: must be None or lie in \(0, 1\]"):
        CLMACohorter(leading_split_family_ratio=value)


@pytest.mark.parametrize("seed", range(3))
def test_one_component_two_means_splits_two_families_and_keeps_one_whole(seed):
    """one_component = "two_means": a group with exactly one component above the broken
    stick is split in two along it (exact 1-D 2-means) unless its sides drift the same way.
    One family drifting by 40 and 80 (one component): k-means by silhouette splits it,
    two_means keeps it whole (ratio 1.09 > 0.7). Two families 15 + 15 apart by 20 along e0:
    split correctly."""
    kw = {"components": "broken_stick", "direction_rule": "none", "leading_split_alpha": 0.01,
          "leading_split_family_ratio": 0.7}
    ids, x, ref = _one_family_two_magnitudes(seed, w=40.0)
    assert CLMACohorter(**kw, one_component="clusterer").cohort(ids, x, ref).n_cohorts == 2
    kept = CLMACohorter(**kw, one_component="two_means").cohort(ids, x, ref)
    assert kept.n_cohorts == 1
    reason = kept.groups[0].reason
    assert reason.startswith("one component above the broken stick: 2-means split (cluster ")
    assert "undone: one family" in reason and _ratio(reason) > 0.7
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(800).astype(np.float32)
    x = ref + rng.standard_normal((30, 800))
    x[:15, 0] += 20.0
    ids = [f"c{i}" for i in range(30)]
    for refine in (False, True):  # the refinement (on by default) keeps a correct split
        two = CLMACohorter(**kw, one_component="two_means", cosine_refinement=refine).cohort(
            ids, x.astype(np.float32), ref)
        assert two.groups[0].reason.startswith("one component above the broken stick: 2-means")
        assert "cosine refinement" not in two.groups[0].reason
        a = two.assignments
        assert len({a[c] for c in ids[:15]}) == 1 and len({a[c] for c in ids[15:]}) == 1
        assert a["c0"] != a["c15"]


@pytest.mark.parametrize("seed", range(3))
def test_tested_two_means_splits_only_a_significant_split(seed):
    """one_component = "tested_two_means": the one-component 2-means split stands only if
    the leading split's test finds it significant. One family whose drift magnitudes are
    spread evenly (0.2w..2w along e0: one component above the broken stick, no gap) is
    split by "two_means" when the family ratio is off, and kept whole by the test (p far
    above 0.01); two families 15 + 15 apart by 20 along e0 are split by both the same way."""
    kw = {"components": "broken_stick", "direction_rule": "none", "leading_split_alpha": 0.01}
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(800).astype(np.float32)
    x = ref + rng.standard_normal((15, 800))
    x[:, 0] += np.linspace(0.2, 2.0, 15) * 30.0
    ids = [f"c{i}" for i in range(15)]
    x = x.astype(np.float32)
    assert CLMACohorter(**kw, one_component="two_means").cohort(ids, x, ref).n_cohorts == 2
    kept = CLMACohorter(**kw, one_component="tested_two_means").cohort(ids, x, ref)
    assert kept.n_cohorts == 1
    reason = kept.groups[0].reason
    assert reason.startswith("one component above the broken stick: 2-means split (cluster ")
    assert reason.endswith(") not significant")
    import re

    assert float(re.search(r"p = ([0-9.]+)", reason).group(1)) > 0.1
    x = ref + rng.standard_normal((30, 800))
    x[:15, 0] += 20.0
    ids = [f"c{i}" for i in range(30)]
    got = [CLMACohorter(**kw, one_component=oc).cohort(ids, x.astype(np.float32), ref)
           for oc in ("two_means", "tested_two_means")]
    assert got[0].assignments == got[1].assignments
    a = got[1].assignments
    assert len({a[c] for c in ids[:15]}) == 1 and len({a[c] for c in ids[15:]}) == 1
    assert a["c0"] != a["c15"]


def test_one_component_is_refused_outside_its_values():
    with pytest.raises(ValueError, match="one_component: must be 'clusterer', 'two_means' or "
                                         "'tested_two_means'"):
        CLMACohorter(one_component="kmeans")


def test_a_kept_split_of_opposite_drifts_says_so_in_words():
    """Two families drifting in opposite directions have a negative across-side cosine:
    the family ratio is -inf internally, and the diagnostics say what that means instead
    of printing "-inf" (seen at label2 alpha 0.3, seed 13, round 4)."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(200).astype(np.float32)
    d = rng.standard_normal((30, 200))
    d[:15, 0] += 8.0
    d[15:, 0] -= 8.0
    ids = [f"c{i}" for i in range(30)]
    res = CLMACohorter(components="broken_stick", direction_rule="none",
                       leading_split_alpha=0.01, leading_split_family_ratio=0.7,
                       one_component="two_means").cohort(ids, (ref + d).astype(np.float32), ref)
    reason = res.groups[0].reason
    assert "across displacement cosine <= 0: the sides drift apart" in reason
    assert "inf" not in reason
    a = res.assignments
    assert len({a[c] for c in ids[:15]}) == 1 and len({a[c] for c in ids[15:]}) == 1
    assert a["c0"] != a["c15"]
