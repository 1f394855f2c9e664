"""clma.rounds: selection, quarantine, FedAvg, per-cohort aggregation, cohorting, merging."""

from __future__ import annotations

import numpy as np
import pytest

from clma.cohort import CLMACohorter, CohortRegistry, signed_ks_statistic
from clma.rounds import (
    ClientUpdate,
    aggregate_per_cohort,
    cohort_quarantined,
    fedavg,
    merge_reconverged,
    quarantine,
    select_clients,
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
