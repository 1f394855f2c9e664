"""clma.rounds: selection, quarantine, FedAvg, per-cohort aggregation, cohorting, merging,
DP-FedAvg with the fixed-denominator estimator."""

from __future__ import annotations

import numpy as np
import pytest

from clma.cohort import CLMACohorter, CohortRegistry, signed_ks_statistic
from clma.rounds import (
    ClientUpdate,
    aggregate_per_cohort,
    clip_update,
    cohort_quarantined,
    dp_aggregate_per_cohort,
    dp_fedavg,
    expected_participants,
    fedavg,
    merge_reconverged,
    quarantine,
    replace_one_sensitivity,
    select_clients,
    selection_size,
)


def _u(cid, cohort, params, n=10, flag=False):
    return ClientUpdate(cid, cohort, np.asarray(params, dtype=np.float32), n, flag)


# ------------------------------------------------------------------ fedavg
def test_fedavg_equals_literal_weighted_mean():
    rng = np.random.default_rng(0)
    vs = [rng.normal(size=50).astype(np.float32) for _ in range(4)]
    ws = [3.0, 1.0, 0.0, 12.5]
    out = fedavg(vs, ws)
    assert out.dtype == np.float32 and out.shape == (50,)
    literal = sum(w * v.astype(np.float64) for w, v in zip(ws, vs, strict=True)) / sum(ws)
    np.testing.assert_array_equal(out, literal.astype(np.float32))
    # hand case
    np.testing.assert_array_equal(
        fedavg([np.array([0.0, 4.0], np.float32), np.array([2.0, 0.0], np.float32)], [1, 3]),
        np.array([1.5, 1.0], np.float32),
    )
    # equal weights = plain mean; one vector = itself
    np.testing.assert_allclose(fedavg(vs, [2, 2, 2, 2]), np.mean(vs, axis=0), rtol=1e-6)
    np.testing.assert_array_equal(fedavg(vs[:1], [7]), vs[0])


@pytest.mark.parametrize(
    ("vectors", "weights"),
    [
        ([], []),
        ([np.zeros(3, np.float32)], [-1.0]),
        ([np.zeros(3, np.float32)], [0.0]),
        ([np.zeros(3, np.float32)] * 2, [1.0]),
        ([np.zeros(3, np.float32), np.zeros(4, np.float32)], [1.0, 1.0]),
        ([np.zeros(3, np.float32)] * 2, [1.0, float("nan")]),
        ([np.zeros(3, np.float32)] * 2, [1.0, float("inf")]),
    ],
)
def test_fedavg_rejects_bad_input(vectors, weights):
    with pytest.raises(ValueError, match="vectors|weights"):
        fedavg(vectors, weights)


# ------------------------------------------------------------------ selection / quarantine
def test_select_clients_count_seeded_subset():
    ids = list(range(20))
    for p, k in ((0.05, 1), (0.25, 5), (0.26, 6), (0.5, 10), (0.999, 20)):
        sel = select_clients(ids, p, np.random.default_rng(3))
        assert len(sel) == k
        assert sel == sorted(set(sel)) and set(sel) <= set(ids)
    a = select_clients(ids, 0.3, np.random.default_rng(3))
    assert a == select_clients(ids, 0.3, np.random.default_rng(3))
    draws = {tuple(select_clients(ids, 0.3, np.random.default_rng(s))) for s in range(10)}
    assert len(draws) > 5
    assert select_clients([5, 2, 9], 1.0, np.random.default_rng(0)) == [2, 5, 9]
    with pytest.raises(ValueError, match="participation"):
        select_clients(ids, 0.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="participation"):
        select_clients(ids, 1.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="client_ids"):
        select_clients([], 0.5, np.random.default_rng(0))


def test_select_clients_uniform():
    counts = np.zeros(10)
    for s in range(2000):
        for c in select_clients(range(10), 0.3, np.random.default_rng(s)):
            counts[c] += 1
    # each client selected with probability 3/10: 600 expected, sd ~20.5
    assert np.all(np.abs(counts - 600) < 100)


def test_quarantine_lists_flagged():
    ups = [_u(3, 0, [0], flag=True), _u(1, 0, [0]), _u(0, 0, [0], flag=True)]
    assert quarantine(ups) == [0, 3]
    assert quarantine([]) == []


# ------------------------------------------------------------------ aggregate_per_cohort
def test_aggregate_per_cohort_excludes_quarantined_and_weights():
    ups = [
        _u(0, 0, [1.0, 1.0], n=10),
        _u(1, 0, [3.0, 5.0], n=30),
        _u(2, 0, [100.0, 100.0], n=10, flag=True),
        _u(3, 1, [2.0, 2.0], n=5),
        _u(4, 1, [4.0, 8.0], n=5),
        _u(5, 2, [9.0, 9.0], n=5, flag=True),
    ]
    models = {0: np.zeros(2, np.float32), 1: np.zeros(2, np.float32),
              2: np.array([7.0, 7.0], np.float32), 3: np.ones(2, np.float32)}
    out = aggregate_per_cohort(ups, quarantine(ups), models)
    np.testing.assert_array_equal(out[0], [(10 * 1 + 30 * 3) / 40, (10 * 1 + 30 * 5) / 40])
    np.testing.assert_array_equal(out[1], [3.0, 5.0])
    np.testing.assert_array_equal(out[2], [7.0, 7.0])  # only a quarantined member: unchanged
    np.testing.assert_array_equal(out[3], [1.0, 1.0])  # no update: unchanged
    assert out is not models and np.array_equal(models[0], [0.0, 0.0])
    # weights scale FedAvg weights; 0 excludes; missing = 1
    w = aggregate_per_cohort(ups, [2, 5], models, weights={1: 0.5, 4: 0.0})
    np.testing.assert_allclose(w[0], [(10 * 1 + 15 * 3) / 25, (10 * 1 + 15 * 5) / 25],
                               rtol=1e-6)
    np.testing.assert_array_equal(w[1], [2.0, 2.0])
    # all weights 0: keeps the model
    z = aggregate_per_cohort(ups, [2, 5], models, weights={3: 0.0, 4: 0.0})
    np.testing.assert_array_equal(z[1], [0.0, 0.0])
    # without quarantine the flagged client is averaged in
    q = aggregate_per_cohort(ups, [], models)
    np.testing.assert_allclose(q[0], [(10 + 90 + 1000) / 50, (10 + 150 + 1000) / 50],
                               rtol=1e-6)


# ------------------------------------------------------------------ cohort_quarantined
N_PARAMS = 600


def _families(seed=0):
    """Start model R; stable clients 0..3 near R; + family 4..6 at R + 1; - family 7..9
    at R - 1. The post-aggregation model of cohort 0 is put far above everything (R + 4),
    so a KS test against it would see every quarantined client as shifted downward."""
    rng = np.random.default_rng(seed)
    start = rng.normal(size=N_PARAMS).astype(np.float32)
    ups = []
    for c in range(4):
        ups.append(_u(c, 0, start + 0.01 * rng.normal(size=N_PARAMS), n=20))
    for c in (4, 5, 6):
        ups.append(_u(c, 0, start + 1.0 + 0.05 * rng.normal(size=N_PARAMS), n=10 + c,
                      flag=True))
    for c in (7, 8, 9):
        ups.append(_u(c, 0, start - 1.0 + 0.05 * rng.normal(size=N_PARAMS), n=10 + c,
                      flag=True))
    post = {0: (start + 4.0).astype(np.float32)}
    return start, ups, post


def test_cohort_quarantined_splits_opposite_families_with_lineage():
    start, ups, post = _families()
    reg = CohortRegistry()
    reg.create_root(list(range(10)), 0)
    models, outcome = cohort_quarantined(ups, quarantine(ups), post, reg, CLMACohorter(),
                                         round_number=3, start_models={0: start})
    groups = sorted(sorted(m) for m in outcome.new_cohorts.values())
    assert groups == [[4, 5, 6], [7, 8, 9]]
    assert set(outcome.parents.values()) == {0}
    for new_id, members in outcome.new_cohorts.items():
        rec = reg.cohort(new_id)
        assert rec.parents == [0] and rec.created_round == 3
        assert sorted(rec.members) == sorted(members)
        assert all(reg.cohort_of(c) == new_id for c in members)
        by = {u.client_id: u for u in ups}
        np.testing.assert_array_equal(
            models[new_id],
            fedavg([by[c].params for c in members], [by[c].n_samples for c in members]))
    split = [e for e in reg.lineage if e.kind == "split"]
    assert len(split) == 1 and split[0].round == 3 and split[0].parents == [0]
    assert sorted(split[0].children) == sorted(outcome.new_cohorts)
    assert reg.members(0) == [0, 1, 2, 3]  # stable clients stay in the parent
    np.testing.assert_array_equal(models[0], post[0])  # parent model untouched here
    assert outcome.diagnostics[0] == {"n_quarantined": 6, "n_groups": 2, "n_atypical": 0}


def test_a_client_alone_in_its_cohort_is_not_split_into_a_new_cohort():
    """Reproducer (issue 46): a flagged client that is its cohort's only member was
    "split" into a new single-client cohort, every round it flagged. Now it is not
    quarantined: its cohort keeps its id and its model is the client's update."""
    rng = np.random.default_rng(5)
    start = rng.normal(size=N_PARAMS).astype(np.float32)
    reg = CohortRegistry()
    reg.create_root(list(range(4)), 0)
    reg.split(0, {0: [3]}, round=2)  # cohort 1 = [3]
    ups = [_u(0, 0, start + 0.01 * rng.normal(size=N_PARAMS)),
           _u(1, 0, start + 0.01 * rng.normal(size=N_PARAMS)),
           _u(2, 0, start - 1.0, flag=True),  # flagged, with cohort-mates
           _u(3, 1, start + 1.0 + rng.normal(size=N_PARAMS), n=12, flag=True)]  # alone
    assert quarantine(ups) == [2, 3]  # without the registry: every flag
    held = quarantine(ups, reg)
    assert held == [2]  # client 3 is alone in cohort 1; client 2 has cohort-mates
    starts = {0: start, 1: start}
    models = aggregate_per_cohort(ups, held, starts)
    np.testing.assert_array_equal(models[1], ups[3].params)  # its update, FedAvg of one
    lineage_before = len(reg.lineage)
    models, outcome = cohort_quarantined(ups, held, models, reg, CLMACohorter(),
                                         round_number=3, start_models=starts)
    assert reg.cohort_of(3) == 1 and reg.cohort(1).status == "active"
    assert all(3 not in m for m in outcome.new_cohorts.values())
    assert [e.clients for e in reg.lineage[lineage_before:] if e.kind == "split"] == [[2]]


def _split(weights=None, atypical=(), new_model=None):
    start, ups, post = _families()
    reg = CohortRegistry()
    reg.create_root(list(range(10)), 0)
    models, outcome = cohort_quarantined(ups, quarantine(ups), post, reg, CLMACohorter(),
                                         round_number=3, start_models={0: start},
                                         new_model=new_model, weights=weights,
                                         atypical=atypical)
    by_members = {tuple(sorted(m)): models[k] for k, m in outcome.new_cohorts.items()}
    return start, {u.client_id: u for u in ups}, by_members, outcome


def test_cohort_quarantined_applies_divergence_weights_to_new_cohort_models():
    _, by, plain, _ = _split()
    start, _, weighted, outcome = _split(weights={4: 0.0, 7: 0.5, 1: 0.0},
                                         atypical=[4, 7, 1])
    assert sorted(weighted) == sorted(plain) == [(4, 5, 6), (7, 8, 9)]  # membership unchanged
    np.testing.assert_array_equal(
        weighted[(4, 5, 6)], fedavg([by[5].params, by[6].params],
                                    [by[5].n_samples, by[6].n_samples]))
    np.testing.assert_array_equal(
        weighted[(7, 8, 9)], fedavg([by[c].params for c in (7, 8, 9)],
                                    [by[7].n_samples * 0.5, by[8].n_samples, by[9].n_samples]))
    assert not np.array_equal(weighted[(7, 8, 9)], plain[(7, 8, 9)])
    # client 1 is flagged but was not quarantined: it does not count here
    assert outcome.diagnostics[0] == {"n_quarantined": 6, "n_groups": 2, "n_atypical": 2}


def test_cohort_quarantined_all_excluded_group_starts_from_the_reference():
    start, _, models, _ = _split(weights={4: 0.0, 5: 0.0, 6: 0.0})
    np.testing.assert_array_equal(models[(4, 5, 6)], start)
    assert models[(4, 5, 6)].dtype == np.float32


def test_cohort_quarantined_new_model_hook_gets_only_members_of_positive_weight():
    seen = {}

    def hook(new_id, members, reference):
        seen[tuple(sorted(u.client_id for u in members))] = reference
        return np.asarray(reference, np.float32) + len(members)

    start, _, models, _ = _split(weights={4: 0.0, 8: 0.5}, new_model=hook)
    assert sorted(seen) == [(5, 6), (7, 8, 9)]  # 4 excluded; 8's 0.5 is the hook's business
    np.testing.assert_array_equal(models[(4, 5, 6)], start + 2)


def test_cohort_quarantined_ks_reference_is_the_start_model():
    start, ups, post = _families(seed=1)
    reg = CohortRegistry()
    reg.create_root(list(range(10)), 0)
    _, outcome = cohort_quarantined(ups, quarantine(ups), post, reg, CLMACohorter(),
                                    round_number=2, start_models={0: start})
    by = {u.client_id: u for u in ups}
    for c in range(4, 10):
        assert outcome.ks_statistics[c] == signed_ks_statistic(by[c].params, start)
    plus = [outcome.ks_statistics[c] for c in (4, 5, 6)]
    minus = [outcome.ks_statistics[c] for c in (7, 8, 9)]
    assert (all(v > 0.2 for v in plus) and all(v < -0.2 for v in minus)) or \
           (all(v < -0.2 for v in plus) and all(v > 0.2 for v in minus))
    # control: against the post-aggregation model every client has the same sign, so a
    # function using it could not have produced the opposite signs asserted above
    against_post = [signed_ks_statistic(by[c].params, post[0]) for c in range(4, 10)]
    assert len({np.sign(v) for v in against_post}) == 1
    assert all(abs(v) > 0.7 for v in against_post)


def test_cohort_quarantined_defaults_reference_to_cohort_models():
    start, ups, _ = _families(seed=2)
    reg = CohortRegistry()
    reg.create_root(list(range(10)), 0)
    _, outcome = cohort_quarantined(ups, quarantine(ups), {0: start}, reg, CLMACohorter(), 1)
    by = {u.client_id: u for u in ups}
    assert outcome.ks_statistics[4] == signed_ks_statistic(by[4].params, start)


def test_cohort_quarantined_uses_select_and_nothing_when_no_quarantine():
    start, ups, post = _families(seed=3)
    reg = CohortRegistry()
    reg.create_root(list(range(10)), 0)
    models, outcome = cohort_quarantined(ups, [], post, reg, CLMACohorter(), 1,
                                         start_models={0: start})
    assert outcome.new_cohorts == {} and reg.active_cohorts() == [0]
    assert models.keys() == post.keys()
    half = N_PARAMS // 2
    _, outcome = cohort_quarantined(ups, quarantine(ups), post, reg, CLMACohorter(), 1,
                                    select=lambda v: v[:half], start_models={0: start})
    by = {u.client_id: u for u in ups}
    assert outcome.ks_statistics[7] == signed_ks_statistic(by[7].params[:half], start[:half])


# ------------------------------------------------------------------ merge_reconverged
def test_merge_reconverged_off_when_threshold_none():
    reg = CohortRegistry()
    root = reg.create_root([0, 1, 2, 3], 0)
    kids = reg.split(root, {0: [0, 1], 1: [2, 3]}, 1)
    ref = np.zeros(4, np.float32)
    d = np.array([1, 2, 3, 4], np.float32)
    models = {kids[0]: ref + d, kids[1]: ref + 2 * d}
    n_events = len(reg.lineage)
    out, merges = merge_reconverged(models, reg, ref, None, 2, {kids[0]: 2, kids[1]: 2})
    assert merges == [] and out == models and out is not models
    assert len(reg.lineage) == n_events and reg.active_cohorts() == sorted(kids.values())


def test_merge_reconverged_merges_parallel_displacements():
    reg = CohortRegistry()
    root = reg.create_root([0, 1, 2, 3, 4], 0)
    kids = reg.split(root, {0: [0, 1, 2], 1: [3, 4]}, 1)
    a, b = kids[0], kids[1]
    ref = np.zeros(4, np.float32)
    d = np.array([1, 2, 3, 4], np.float32)
    models = {a: ref + d, b: ref + 2 * d}  # same direction: cosine distance 0
    out, merges = merge_reconverged(models, reg, ref, 0.01, 5, {a: 3, b: 2})
    assert len(merges) == 1
    group, new = merges[0]
    assert group == [a, b]
    np.testing.assert_allclose(out[new], (3 * d + 2 * 2 * d) / 5, rtol=1e-6)
    rec = reg.cohort(new)
    assert rec.parents == [a, b] and rec.created_round == 5
    assert sorted(rec.members) == [0, 1, 2, 3, 4]
    # opposite displacements never merge
    reg2 = CohortRegistry()
    r2 = reg2.create_root([0, 1], 0)
    k2 = reg2.split(r2, {0: [0], 1: [1]}, 1)
    _, none = merge_reconverged({k2[0]: d, k2[1]: -d}, reg2, ref, 0.5, 2, {})
    assert none == []


# ------------------------------------------------------------------ DP-FedAvg (issue 21 item 3)


def _updates_around(ref, rng, scales):
    return [(ref + s * rng.normal(size=ref.shape)).astype(np.float32) for s in scales]


def _clipped_sum(params, ref, c):
    deltas = [p.astype(np.float64) - ref.astype(np.float64) for p in params]
    return sum((d * min(1.0, c / np.linalg.norm(d)) for d in deltas), np.zeros(ref.shape))


def test_dp_fedavg_fixed_denominator_is_the_literal_formula():
    rng = np.random.default_rng(3)
    ref = rng.normal(size=30).astype(np.float32)
    params = _updates_around(ref, rng, (0.01, 5.0, 0.2, 30.0))
    c, z, d = 1.0, 0.8, 2.5
    res = dp_fedavg(params, ref, clipping_bound=c, noise_multiplier=z, denominator=d, seed=11)
    noise = np.random.default_rng(11).normal(0.0, z * 2 * c, size=30)  # std z * 2C on the sum
    expected = (ref.astype(np.float64) + (_clipped_sum(params, ref, c) + noise) / d)
    np.testing.assert_allclose(res.model, expected.astype(np.float32), rtol=0, atol=1e-6)
    assert res.model.dtype == np.float32 and res.model.shape == (30,)
    assert res.sigma == z * 2 * c / d
    assert (res.denominator, res.estimator, res.n_clients) == (2.5, "fixed_denominator", 4)
    norms = [np.linalg.norm(p.astype(np.float64) - ref) for p in params]
    assert res.n_clipped == sum(nm > c for nm in norms) == 3
    assert res.noise_source == "seeded-simulation"
    gen = dp_fedavg(params, ref, clipping_bound=c, noise_multiplier=z, denominator=d,
                    seed=np.random.default_rng(11))
    np.testing.assert_array_equal(gen.model, res.model)


def test_replace_one_sensitivity_of_the_clipped_sum_is_twice_the_bound():
    c = 0.75
    assert replace_one_sensitivity(c) == 1.5
    rng = np.random.default_rng(0)
    e = rng.normal(size=50)
    a, _ = clip_update(10 * e, c)
    b, _ = clip_update(-10 * e, c)
    assert np.linalg.norm(a - b) == pytest.approx(2 * c, rel=1e-12)  # attained
    others = [clip_update(rng.normal(size=50) * s, c)[0] for s in (0.01, 0.1, 1, 10)] * 3
    rest = sum(others)
    for _ in range(200):  # replacing one client never moves the sum by more than 2C
        u, v = (clip_update(rng.normal(size=50) * rng.uniform(0, 5), c)[0] for _ in range(2))
        assert np.linalg.norm((rest + u) - (rest + v)) <= 2 * c * (1 + 1e-12)
    with pytest.raises(ValueError, match="clipping_bound"):
        replace_one_sensitivity(0.0)


def _noise_std_check(noise, sigma):
    """Sample std and mean within 4 standard errors of N(0, sigma): the std of a sample of
    size m has standard error sigma / sqrt(2 (m - 1)), the mean sigma / sqrt(m)."""
    m = noise.size
    se = sigma / np.sqrt(2 * (m - 1))
    return abs(noise.std(ddof=1) - sigma) < 4 * se and abs(noise.mean()) < 4 * sigma / np.sqrt(m)


@pytest.mark.parametrize("seeded", [True, False])
def test_dp_fedavg_noise_std_does_not_depend_on_the_realised_number_of_clients(seeded):
    from scipy import stats

    n_params = 40_000 if seeded else 4_000
    c, z, d = 0.7, 1.3, 10.0
    sigma = z * 2 * c / d
    rng = np.random.default_rng(5)
    ref = rng.normal(size=n_params).astype(np.float32)
    stds = {}
    for n in (1, 10, 40):
        params = _updates_around(ref, rng, rng.uniform(0.0, 0.02, size=n))
        res = dp_fedavg(params, ref, clipping_bound=c, noise_multiplier=z, denominator=d,
                        seed=100 + n if seeded else None)
        assert res.sigma == sigma and res.n_clients == n
        noise = (res.model.astype(np.float64) - ref.astype(np.float64)
                 - _clipped_sum(params, ref, c) / d)
        assert _noise_std_check(noise, sigma), n
        assert stats.kstest(noise, "norm", args=(0.0, sigma)).pvalue > 1e-4
        stds[n] = noise.std(ddof=1)
    # pairwise: the difference of two independent sample stds has se sigma / sqrt(m - 1)
    se_diff = sigma / np.sqrt(n_params - 1)
    assert max(stds.values()) - min(stds.values()) < 4 * se_diff
    # the same check rejects the old realised-n estimator (noise z C / n on the mean)
    old_rng = np.random.default_rng(7)
    old_noise = {n: old_rng.normal(0.0, z * c / n, size=n_params) for n in (1, 10)}
    assert not _noise_std_check(old_noise[1], sigma) or not _noise_std_check(old_noise[10], sigma)
    assert abs(old_noise[1].std() - old_noise[10].std()) > 4 * se_diff


def test_dp_fedavg_with_no_participant_releases_noise_only():
    ref = np.zeros(20_000, dtype=np.float32)
    res = dp_fedavg([], ref, clipping_bound=0.5, noise_multiplier=2.0, denominator=4.0, seed=3)
    assert res.n_clients == 0 and res.sigma == 0.5
    assert _noise_std_check(res.model.astype(np.float64), 0.5)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "three"])
def test_dp_fedavg_rejects_a_bad_denominator(bad):
    ref = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match="denominator must be a positive finite number"):
        dp_fedavg([ref], ref, clipping_bound=1.0, noise_multiplier=1.0, denominator=bad, seed=0)


def test_dp_fedavg_needs_a_denominator():
    ref = np.zeros(4, dtype=np.float32)
    with pytest.raises(TypeError, match="denominator"):
        dp_fedavg([ref] * 4, ref, clipping_bound=2.0, noise_multiplier=1.5, seed=1)


def test_dp_aggregate_per_cohort_releases_exactly_the_cohorts_with_denominators():
    rng = np.random.default_rng(8)
    models = {c: rng.normal(size=12).astype(np.float32) for c in (0, 1, 2, 3)}
    ups = [_u(10, 0, models[0] + 0.3), _u(11, 0, models[0] - 0.2), _u(12, 1, models[1] + 5.0),
           _u(13, 2, models[2] + 1.0)]
    # cohort 2's only client is quarantined; cohort 3 is not released this round
    dens = {0: 2.0, 1: 1.5, 2: 1.0}
    out, res = dp_aggregate_per_cohort(ups, [13], models, clipping_bound=0.5,
                                       noise_multiplier=1.0, denominators=dens, seed=4)
    assert sorted(res) == [0, 1, 2]
    np.testing.assert_array_equal(out[3], models[3])
    by_cohort = {0: [ups[0], ups[1]], 1: [ups[2]], 2: []}
    for cid, members in by_cohort.items():
        literal = dp_fedavg([u.params for u in members], models[cid], clipping_bound=0.5,
                            noise_multiplier=1.0, denominator=dens[cid],
                            seed=np.random.default_rng([4, cid]))
        np.testing.assert_array_equal(out[cid], literal.model)
        assert res[cid].n_clients == len(members) and res[cid].sigma == 2 * 0.5 / dens[cid]
    assert not np.array_equal(out[2], models[2])  # released even though nobody took part
    # a Generator is drawn from in increasing cohort order
    gen = np.random.default_rng(9)
    out_g, _ = dp_aggregate_per_cohort(ups, [13], models, clipping_bound=0.5,
                                       noise_multiplier=1.0, denominators=dens,
                                       seed=np.random.default_rng(9))
    for cid in (0, 1, 2):
        literal = dp_fedavg([u.params for u in by_cohort[cid]], models[cid], clipping_bound=0.5,
                            noise_multiplier=1.0, denominator=dens[cid], seed=gen)
        np.testing.assert_array_equal(out_g[cid], literal.model)


def test_dp_aggregate_per_cohort_denominator_errors():
    models = {0: np.zeros(3, dtype=np.float32), 1: np.zeros(3, dtype=np.float32)}
    ups = [_u(1, 0, [0.1, 0, 0]), _u(2, 1, [0, 0.1, 0])]
    kw = {"clipping_bound": 1.0, "noise_multiplier": 1.0, "seed": 0}
    with pytest.raises(ValueError, match="cohort 1 has usable updates but no denominator"):
        dp_aggregate_per_cohort(ups, [], models, denominators={0: 1.0}, **kw)
    with pytest.raises(ValueError, match="cohort 5 has no model"):
        dp_aggregate_per_cohort(ups, [], models, denominators={0: 1.0, 1: 1.0, 5: 1.0}, **kw)
    with pytest.raises(ValueError, match="denominator must be a positive"):
        dp_aggregate_per_cohort(ups, [], models, denominators={0: 1.0, 1: 0.0}, **kw)
    with pytest.raises(TypeError, match="denominators"):
        dp_aggregate_per_cohort(ups, [], models, **kw)


def test_selection_size_and_expected_participants():
    ids = list(range(20))
    for p in (0.05, 0.25, 0.26, 0.5, 0.999, 1.0):
        assert selection_size(20, p) == len(select_clients(ids, p, np.random.default_rng(0)))
    assert (selection_size(60, 1.0), selection_size(60, 0.25), selection_size(1, 0.01)) == (60, 15, 1)
    assert expected_participants(15, population_size=60, sample_size=30) == 7.5
    assert expected_participants(21, population_size=60, sample_size=60) == 21.0
    assert expected_participants(1, population_size=60, sample_size=6) == 1.0  # at least 1
    for bad in ({"population_size": 0}, {"population_size": True}, {"population_size": 2.0}):
        with pytest.raises(ValueError, match="population_size"):
            selection_size(participation=0.5, **bad)
    with pytest.raises(ValueError, match="participation"):
        selection_size(10, 0.0)
    with pytest.raises(ValueError, match="sample_size"):
        expected_participants(3, population_size=10, sample_size=11)
    with pytest.raises(ValueError, match="cohort_size"):
        expected_participants(11, population_size=10, sample_size=5)
    with pytest.raises(ValueError, match="cohort_size"):
        expected_participants(-1, population_size=10, sample_size=5)


def test_server_step_is_start_plus_eta_times_the_aggregate_change():
    """FedOpt's server SGD step (Reddi et al. 2021, Alg. 1): start + eta * (agg - start),
    float32 out; cohorts without a start model (new) unchanged; eta = 1 is FedAvg."""
    from clma.rounds import server_step

    start = {0: np.array([0.0, 1.0, -2.0], np.float32), 1: np.array([1.0, 1.0, 1.0], np.float32)}
    agg = {0: np.array([1.0, 0.0, -1.0], np.float32), 1: np.array([1.0, 1.0, 1.0], np.float32),
           7: np.array([5.0, 5.0, 5.0], np.float32)}
    out = server_step(start, agg, 1.5)
    np.testing.assert_array_equal(out[0], np.array([1.5, -0.5, -0.5], np.float32))
    np.testing.assert_array_equal(out[1], start[1])  # no change -> no step
    np.testing.assert_array_equal(out[7], agg[7])    # a new cohort keeps its aggregate
    assert all(v.dtype == np.float32 for v in out.values())
    np.testing.assert_array_equal(server_step(start, agg, 1.0)[0], agg[0])
    for bad in (0.0, -1.0, 11.0):
        with pytest.raises(ValueError, match="training.server_learning_rate"):
            server_step(start, agg, bad)


def test_server_step_with_momentum_is_fedavgm_with_the_velocity_clipped_to_the_change():
    """FedAvgM (Hsu et al. 2019) as the server optimizer: v = beta * c * velocity + (agg -
    start) with c = min(1, ||agg - start|| / ||velocity||), model = start + eta * v (float64,
    float32 out): the carried velocity never counts more than the round's own change, so a
    step is at most eta * (1 + beta) times it. A cohort without a velocity starts at 0 (the
    plain step); server_velocity gives (model - start) / eta back."""
    from clma.rounds import server_step, server_velocity

    start = {0: np.array([0.0, 1.0, -2.0], np.float32), 3: np.array([1.0, 2.0, 3.0], np.float32),
             5: np.array([1.0, 1.0, 1.0], np.float32)}
    agg = {0: np.array([1.0, 0.0, -1.0], np.float32), 3: np.array([4.0, 2.0, 7.0], np.float32),
           5: np.array([2.0, 2.0, 2.0], np.float32)}
    # cohort 0: ||velocity|| 1.22 < ||change|| 1.73, carried whole; cohort 3: ||velocity|| 10
    # against ||change|| 5, carried at half its length
    vel = {0: np.array([0.5, -1.0, 0.5], np.float32), 3: np.array([0.0, 10.0, 0.0], np.float32)}
    out = server_step(start, agg, 1.5, momentum=0.25, velocity=vel)
    # v0 = 0.25 * [0.5, -1, 0.5] + [1, -1, 1];  v3 = 0.25 * 0.5 * [0, 10, 0] + [3, 0, 4]
    np.testing.assert_array_equal(out[0], np.array([1.6875, -0.875, -0.3125], np.float32))
    np.testing.assert_array_equal(out[3], np.array([5.5, 3.875, 9.0], np.float32))
    np.testing.assert_array_equal(out[5], server_step(start, agg, 1.5)[5])  # no velocity
    np.testing.assert_array_equal(server_step(start, agg, 1.5, momentum=0.0, velocity=vel)[0],
                                  server_step(start, agg, 1.5)[0])
    v = server_velocity(start, out, 1.5)
    np.testing.assert_array_equal(v[3], np.array([3.0, 1.25, 4.0], np.float32))
    assert v[0].dtype == np.float32 and set(v) == {0, 3, 5}
    rng = np.random.default_rng(0)
    for _ in range(50):  # the bound, on random vectors and velocities of any length
        s0, a0 = rng.normal(size=20), rng.normal(size=20)
        big = rng.normal(size=20) * rng.uniform(0.01, 100)
        step = server_step({1: s0}, {1: a0}, 2.0, momentum=0.5, velocity={1: big})[1] - s0
        assert np.linalg.norm(step) <= 2.0 * 1.5 * np.linalg.norm(a0 - s0) * (1 + 1e-6)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="training.server_momentum"):
            server_step(start, agg, 1.5, momentum=bad)
    with pytest.raises(ValueError, match="cohort 0's velocity"):
        server_step(start, agg, 1.5, momentum=0.3, velocity={0: np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="training.server_learning_rate"):
        server_velocity(start, out, 0.0)


def test_server_step_cohorts_by_scope():
    """drift_cohorts: cohorts with a parent (split children, merges, a merge with the root
    included); the parentless root and a second root are not stepped; all: every id."""
    from clma.rounds import server_step_cohorts

    reg = CohortRegistry()
    root = reg.create_root(range(10), 0)
    other = reg.create_root([10, 11], 0)
    kids = reg.split(root, {0: [0, 1, 2], 1: [3, 4, 5]}, 4)
    a, b = kids[0], kids[1]
    assert server_step_cohorts(reg, [root, other, a, b], "drift_cohorts") == sorted([a, b])
    assert server_step_cohorts(reg, [b, a, other, root], "all") == sorted([root, other, a, b])
    merged = reg.merge([root, a], 6)
    assert reg.cohort(merged).parents == sorted([root, a])
    assert server_step_cohorts(reg, [merged, b, other], "drift_cohorts") == sorted([merged, b])
    with pytest.raises(ValueError, match="training.server_learning_rate_scope"):
        server_step_cohorts(reg, [root], "root")
