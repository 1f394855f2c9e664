"""CLMACohorter: paper-exact form, the zero-mean improvement, scenarios and edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import ks_2samp
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score

import clma.cohort.cohorter as cohorter_mod
from clma.cohort import (
    AutoKMeans,
    CLMACohorter,
    CohortAssignment,
    Cohorter,
    SortedReference,
    signed_ks_statistic,
)
from clma.params import NonFiniteParameterError, ParameterAlignmentError

P = 50_000


def zero_mean_families(seed: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Issue 3 item 6a: 3 families x 4 clients, displacement N(0, 0.01) per family,
    client noise N(0, 0.002), reference N(0, 0.05) (standard deviations)."""
    rng = np.random.default_rng(seed)
    ref = rng.normal(0, 0.05, P).astype(np.float32)
    rows, truth = [], []
    for fam in range(3):
        disp = rng.normal(0, 0.01, P)
        for _ in range(4):
            rows.append(ref + disp + rng.normal(0, 0.002, P))
            truth.append(fam)
    return np.asarray(rows, dtype=np.float32), ref, truth


def shifted_families(seed: int, means: list[float], per: int = 4):
    rng = np.random.default_rng(seed)
    ref = rng.normal(0, 0.05, P).astype(np.float32)
    rows, truth = [], []
    for fam, mu in enumerate(means):
        disp = rng.normal(mu, 0.01, P)
        for _ in range(per):
            rows.append(ref + disp + rng.normal(0, 0.002, P))
            truth.append(fam)
    return np.asarray(rows, dtype=np.float32), ref, truth


def run(cohorter: Cohorter, matrix: np.ndarray, ref: np.ndarray) -> tuple[CohortAssignment,
                                                                           np.ndarray]:
    ids = [f"client-{i}" for i in range(matrix.shape[0])]
    res = cohorter.cohort(ids, matrix, ref)
    return res, res.labels(ids)


# ---------------------------------------------------------------- the paper's exact form


def literal_algorithm3(matrix: np.ndarray, ref: np.ndarray, threshold: float = 0.95):
    """Published Algorithm 3 written out literally: sign of scipy's KS statistic, then per
    sign group the eig of the p x p matrix S^T S (uncentered), projection on the components
    explaining the threshold, k-means with k = 2."""
    signs = []
    for row in matrix:
        r = ks_2samp(row, ref)
        signs.append(r.statistic_sign if r.statistic > 0 else 1)
    labels = np.empty(matrix.shape[0], dtype=object)
    for s in (1, -1):
        idx = [i for i, v in enumerate(signs) if v == s]
        if not idx:
            continue
        S = matrix[idx].astype(np.float64)
        lam, V = np.linalg.eigh(S.T @ S)
        order = np.argsort(lam)[::-1]
        lam, V = np.clip(lam[order], 0, None), V[:, order]
        k = int(np.searchsorted(np.cumsum(lam / lam.sum()), threshold, side="right")) + 1
        proj = S @ V[:, :k]
        km = KMeans(n_clusters=min(2, len(idx)), n_init=10, random_state=0).fit_predict(proj)
        for i, lab in zip(idx, km, strict=True):
            labels[i] = (s, int(lab))
    return labels


def test_exact_form_reproduces_literal_algorithm() -> None:
    rng = np.random.default_rng(42)
    p = 300
    ref = rng.normal(0, 0.05, p).astype(np.float32)
    rows = []
    for mu in (0.03, 0.03, -0.03, -0.03):  # two sub-families per direction
        disp = rng.normal(mu, 0.02, p)
        for _ in range(3):
            rows.append(ref + disp + rng.normal(0, 0.004, p))
    matrix = np.asarray(rows, dtype=np.float32)
    exact = CLMACohorter(center=False, clusterer=AutoKMeans(fixed_k=2))
    assert exact.effective_direction_rule == "sign"
    res, ours = run(exact, matrix, ref)
    literal = literal_algorithm3(matrix, ref)
    lit_codes = {key: i for i, key in enumerate(dict.fromkeys(literal.tolist()))}
    lit_labels = np.array([lit_codes[k] for k in literal.tolist()])
    assert ours.tolist() == lit_labels.tolist()  # both in first-appearance order
    assert res.n_cohorts == 4


# ---------------------------------------------------------------- issue 3 item 6a


@pytest.mark.parametrize("seed", range(4))
def test_default_recovers_zero_mean_families(seed: int) -> None:
    matrix, ref, truth = zero_mean_families(seed)
    res, labels = run(CLMACohorter(), matrix, ref)
    assert adjusted_rand_score(truth, labels) == 1.0
    assert res.n_cohorts == 3
    assert set(res.directions.values()) == {"undirected"}
    # The sign is noise here: |D+ - D-| stays below the critical value for every client.
    assert all(abs(res.d_plus[c] - res.d_minus[c]) <= res.direction_threshold
               for c in res.assignments)


def test_sign_trusting_mode_splits_zero_mean_families() -> None:
    # The reference package's behaviour (sign always trusted), on the same data.
    n_cohorts, aris = [], []
    for seed in range(10):
        matrix, ref, truth = zero_mean_families(seed)
        res, labels = run(CLMACohorter(direction_rule="sign"), matrix, ref)
        n_cohorts.append(res.n_cohorts)
        aris.append(adjusted_rand_score(truth, labels))
        assert "undirected" not in res.directions.values()
    assert sum(a < 1.0 for a in aris) >= 5 and np.mean(n_cohorts) > 3.5
    assert n_cohorts[8] == 6 and aris[8] < 0.6  # the 6 cohorts, ARI ~0.5


def test_opposite_mean_shifts_give_two_cohorts() -> None:
    matrix, ref, truth = shifted_families(1, [0.01, -0.01])
    res, labels = run(CLMACohorter(), matrix, ref)
    assert adjusted_rand_score(truth, labels) == 1.0 and res.n_cohorts == 2
    dirs = [res.directions[f"client-{i}"] for i in range(8)]
    # Larger values => negative signed KS (sample ECDF below the reference's).
    assert dirs == ["negative"] * 4 + ["positive"] * 4


def test_identical_drifts_one_cohort_and_why_centering() -> None:
    matrix, ref, _ = shifted_families(2, [0.01], per=8)
    res, _ = run(CLMACohorter(), matrix, ref)
    assert res.n_cohorts == 1
    # Uncentered, the shared component absorbs the variance and identically drifted
    # clients look clusterable (the reason the default centers).
    unc, _ = run(CLMACohorter(center=False), matrix, ref)
    assert unc.n_cohorts > 1
    assert unc.groups[0].n_components == 1 and unc.groups[0].retained_variance > 0.99


def test_identical_zero_mean_drift_one_cohort() -> None:
    rng = np.random.default_rng(3)
    ref = rng.normal(0, 0.05, P).astype(np.float32)
    disp = rng.normal(0, 0.01, P)
    matrix = np.asarray([ref + disp + rng.normal(0, 0.002, P) for _ in range(8)], np.float32)
    assert run(CLMACohorter(), matrix, ref)[0].n_cohorts == 1


def test_unshifted_copies_one_cohort() -> None:
    rng = np.random.default_rng(4)
    ref = rng.normal(0, 0.05, P).astype(np.float32)
    exact_copies = np.tile(ref, (5, 1))
    res, labels = run(CLMACohorter(), exact_copies, ref)
    assert labels.tolist() == [0] * 5 and set(res.ks_statistics.values()) == {0.0}
    noisy = (ref + rng.normal(0, 0.002, (6, P))).astype(np.float32)
    assert run(CLMACohorter(), noisy, ref)[0].n_cohorts == 1


# ---------------------------------------------------------------- outputs and options


def test_statistics_and_ids_contiguous_first_appearance() -> None:
    matrix, ref, _ = shifted_families(5, [-0.01, 0.01, -0.01], per=2)
    ids = ["z", "y", "x", "w", "v", "u"]
    res = CLMACohorter().cohort(ids, matrix, ref)
    for i, cid in enumerate(ids):
        assert res.ks_statistics[cid] == signed_ks_statistic(matrix[i], ref)
    assert list(res.assignments) == ids
    seen: list[int] = []
    for cid in ids:
        g = res.assignments[cid]
        if g not in seen:
            seen.append(g)
    assert seen == list(range(len(seen)))
    assert res.groups_by_cohort() == {g: res.members(g) for g in seen}


def test_min_ks_magnitude_pools_no_shift() -> None:
    rng = np.random.default_rng(6)
    ref = rng.normal(0, 0.05, P).astype(np.float32)
    still = (ref + rng.normal(0, 0.0005, (3, P))).astype(np.float32)
    moved = (ref + rng.normal(0.02, 0.01, (3, P))).astype(np.float32)
    matrix = np.concatenate([still, moved])
    res, labels = run(CLMACohorter(min_ks_magnitude=0.05), matrix, ref)
    assert [res.directions[f"client-{i}"] for i in range(6)] == ["no_shift"] * 3 + [
        "negative"] * 3
    assert labels.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="min_ks_magnitude"):
        CLMACohorter(min_ks_magnitude=-0.1)


def test_reference_sorted_once_per_call(monkeypatch) -> None:
    calls = []

    class Counting(SortedReference):
        def __init__(self, reference, **kw):
            calls.append(1)
            super().__init__(reference, **kw)

    monkeypatch.setattr(cohorter_mod, "SortedReference", Counting)
    matrix, ref, _ = shifted_families(7, [0.01, -0.01], per=3)
    CLMACohorter(n_jobs=2).cohort(list(range(6)), matrix, ref)
    assert len(calls) == 1


def test_threaded_and_serial_ks_agree() -> None:
    matrix, ref, _ = zero_mean_families(0)
    a = CLMACohorter(n_jobs=1).cohort(list(range(12)), matrix, ref)
    b = CLMACohorter(n_jobs=2).cohort(list(range(12)), matrix, ref)
    assert a.ks_statistics == b.ks_statistics and a.assignments == b.assignments


# ---------------------------------------------------------------- edge cases (item 7)


def test_no_one_and_two_clients() -> None:
    rng = np.random.default_rng(8)
    ref = rng.normal(0, 0.05, 1000).astype(np.float32)
    empty = CLMACohorter().cohort([], np.empty((0, 1000), np.float32), ref)
    assert empty.assignments == {} and empty.n_cohorts == 0
    one = CLMACohorter().cohort(["a"], (ref + 0.01)[None, :], ref)
    assert one.assignments == {"a": 0} and one.groups[0].reason == "single client"
    # Two clients in one direction group: AutoKMeans keeps them together (no silhouette
    # for two points); the exact form with k = 2 separates them.
    two = np.stack([ref + 0.01, ref + 0.01 + rng.normal(0, 0.01, 1000)]).astype(np.float32)
    assert CLMACohorter().cohort(["a", "b"], two, ref).assignments == {"a": 0, "b": 0}
    assert CLMACohorter(clusterer=AutoKMeans(fixed_k=2)).cohort(
        ["a", "b"], two, ref).assignments == {"a": 0, "b": 1}
    # Two clients in opposite directions: separated by the direction split.
    opp = np.stack([ref + 0.02, ref - 0.02]).astype(np.float32)
    assert CLMACohorter().cohort(["a", "b"], opp, ref).assignments == {"a": 0, "b": 1}


def test_all_clients_quarantined_including_stationary() -> None:
    # Whole federation flagged: 4 unshifted + 2 families of opposite shift.
    rng = np.random.default_rng(9)
    ref = rng.normal(0, 0.05, P).astype(np.float32)
    rows = [ref + rng.normal(0, 0.002, P) for _ in range(4)]
    for mu in (0.01, -0.01):
        disp = rng.normal(mu, 0.01, P)
        rows += [ref + disp + rng.normal(0, 0.002, P) for _ in range(4)]
    res, labels = run(CLMACohorter(), np.asarray(rows, np.float32), ref)
    assert adjusted_rand_score([0] * 4 + [1] * 4 + [2] * 4, labels) == 1.0


def test_identical_vectors_zero_variance_after_centering() -> None:
    rng = np.random.default_rng(10)
    ref = rng.normal(0, 0.05, 2000).astype(np.float32)
    same = np.tile(ref + np.float32(0.02), (4, 1))
    res = CLMACohorter().cohort(list("abcd"), same, ref)
    assert res.n_cohorts == 1
    g = res.groups[0]
    assert g.n_components == 0 and g.retained_variance == 0.0 and g.k == 1
    # Paper form on identical vectors: one component, identical scores, one cluster.
    exact = CLMACohorter(center=False, clusterer=AutoKMeans(fixed_k=2)).cohort(
        list("abcd"), same, ref)
    assert exact.n_cohorts == 1


def test_direction_group_of_one() -> None:
    matrix, ref, _ = shifted_families(11, [0.01, -0.01], per=3)
    matrix = matrix[:4]  # 3 negative + 1 positive
    res, labels = run(CLMACohorter(), matrix, ref)
    assert labels.tolist() == [0, 0, 0, 1]
    lone = [g for g in res.groups if g.direction == "positive"][0]
    assert lone.members == ("client-3",) and lone.reason == "single client"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_client_rejected_by_name(bad: float) -> None:
    matrix, ref, _ = shifted_families(12, [0.01], per=3)
    matrix[1, 123] = bad
    with pytest.raises(NonFiniteParameterError,
                       match="parameters of client 'client-1' contain NaN or inf"):
        run(CLMACohorter(), matrix, ref)
    ref2 = ref.copy()
    ref2[0] = bad
    with pytest.raises(NonFiniteParameterError, match="reference"):
        CLMACohorter().cohort(["a"], matrix[:1] * 0 + 1, ref2)


def test_vectors_of_different_length_rejected_by_field() -> None:
    ref = np.zeros(10, np.float32)
    with pytest.raises(ParameterAlignmentError, match=r"matrix: vector of client 'b' has shape"):
        CLMACohorter().cohort(["a", "b"], [np.ones(10, np.float32), np.ones(9, np.float32)], ref)
    with pytest.raises(ParameterAlignmentError, match="matrix: rows have 9 parameters"):
        CLMACohorter().cohort(["a"], np.ones((1, 9), np.float32), ref)
    with pytest.raises(ParameterAlignmentError, match="matrix: has 1 rows but client_ids"):
        CLMACohorter().cohort(["a", "b"], np.ones((1, 10), np.float32), ref)
    with pytest.raises(ParameterAlignmentError, match="client_ids: must be unique"):
        CLMACohorter().cohort(["a", "a"], np.ones((2, 10), np.float32), ref)


def test_sequence_of_vectors_accepted() -> None:
    matrix, ref, _ = shifted_families(13, [0.01, -0.01], per=2)
    a = CLMACohorter().cohort(list(range(4)), list(matrix), ref)
    b = CLMACohorter().cohort(list(range(4)), matrix, ref)
    assert a.assignments == b.assignments


def test_constructor_validation() -> None:
    with pytest.raises(TypeError, match="clusterer"):
        CLMACohorter(clusterer="kmeans")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="variance_threshold"):
        CLMACohorter(variance_threshold=1.5)
    with pytest.raises(ValueError, match="direction_rule"):
        CLMACohorter(direction_rule="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="direction_alpha"):
        CLMACohorter(direction_alpha=1.0)
    assert CLMACohorter().effective_direction_rule == "established"
    assert CLMACohorter(center=False, direction_rule="established").effective_direction_rule \
        == "established"


# ---------------------------------------------------------------- issue 14 item 6: noise floor


def _identical_trial(seed: int, perturb: float = 0.0):
    """Clients that drifted identically: ``n`` copies of one drifted vector, optionally
    perturbed by ``perturb`` (relative to nothing: an absolute 1e-12 jitter in float64)."""
    rng = np.random.default_rng(seed)
    p = 2000
    ref = rng.normal(0, 0.1, p).astype(np.float32)
    drifted = ref + rng.normal(0.05, 0.05, p).astype(np.float32)
    n = int(rng.integers(4, 20))
    if perturb == 0.0:
        return np.tile(drifted, (n, 1)).astype(np.float32), ref
    return drifted.astype(np.float64) + rng.normal(0, perturb, (n, p)), ref


@pytest.mark.parametrize("perturb", [0.0, 1e-12])
def test_identically_drifted_clients_are_one_cohort_in_every_trial(perturb: float) -> None:
    splits = []
    for seed in range(60):
        matrix, ref = _identical_trial(seed, perturb)
        res, _ = run(CLMACohorter(), matrix, ref)
        if res.n_cohorts != 1:
            splits.append((seed, res.n_cohorts))
    assert splits == []


def test_noise_floor_is_why_identical_clients_stay_together() -> None:
    # Without the floor the silhouette on round-off noise splits some trials (seed 1: the
    # scores of 11 bit-identical rows are pure noise, silhouette ~0.7-0.8).
    no_floor = CLMACohorter(spread_floor=None)
    split = [s for s in range(60) if run(no_floor, *_identical_trial(s))[0].n_cohorts > 1]
    assert len(split) >= 3
    res, _ = run(CLMACohorter(), *_identical_trial(split[0]))
    assert res.n_cohorts == 1
    assert res.groups[0].reason == "spread below the floor (floating-point noise)"
    assert CLMACohorter().effective_spread_floor == 1e-5


def test_noise_floor_keeps_separated_families_apart() -> None:
    matrix, ref, truth = shifted_families(1, [0.01, -0.01])
    res, labels = run(CLMACohorter(), matrix, ref)
    assert adjusted_rand_score(truth, labels) == 1.0 and res.n_cohorts == 2
    # two families in ONE direction group (zero-mean), still split
    matrix, ref, truth = zero_mean_families(0)
    res, labels = run(CLMACohorter(), matrix, ref)
    assert adjusted_rand_score(truth, labels) == 1.0
    # a clear two-family case whose spread is small but far above float32 round-off
    rng = np.random.default_rng(5)
    ref = rng.normal(0, 0.1, 2000).astype(np.float32)
    base = ref + rng.normal(0.05, 0.05, 2000).astype(np.float32)
    other = base + np.float32(1e-3) * rng.normal(0, 1, 2000).astype(np.float32)
    two = np.asarray([base] * 5 + [other] * 5, np.float32)
    res, labels = run(CLMACohorter(), two, ref)
    assert adjusted_rand_score([0] * 5 + [1] * 5, labels) == 1.0


def test_paper_exact_form_has_no_floor() -> None:
    exact = CLMACohorter(center=False, clusterer=AutoKMeans(fixed_k=2))
    assert exact.effective_spread_floor is None
    explicit = CLMACohorter(center=False, clusterer=AutoKMeans(fixed_k=2), spread_floor=None)
    for seed in range(5):
        matrix, ref, _ = shifted_families(seed, [0.01, 0.01, -0.01], per=3)
        assert run(exact, matrix, ref)[0].assignments == run(explicit, matrix, ref)[0].assignments
    with pytest.raises(ValueError, match="spread_floor"):
        CLMACohorter(spread_floor=1.5)
    with pytest.raises(ValueError, match="spread_floor"):
        CLMACohorter(spread_floor="tiny")  # type: ignore[arg-type]
