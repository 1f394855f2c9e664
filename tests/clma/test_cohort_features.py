"""Relative cohorting features (clma.cohort.features): the literal formula, the running
mean, the state round trip, and a known case where the published features fail."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from clma.cohort import AutoKMeans, CLMACohorter, CohortAssignment, Cohorter, CohortRegistry
from clma.cohort.features import UpdateHistory, relative_features, relative_rows
from clma.engine.state import ServerState, restore_files, snapshot_files
from clma.rounds import ClientUpdate, cohort_quarantined


def test_relative_features_literal_formula() -> None:
    rng = np.random.default_rng(0)
    d = rng.normal(size=(3, 4))
    hist = [rng.normal(size=(2, 4)), rng.normal(size=(3, 4)), None]
    means = [h.mean(axis=0) if h is not None else None for h in hist]
    got = relative_features(d, means)
    for i in range(3):
        for j in range(4):
            want = d[i, j] - (sum(hist[i][s, j] for s in range(len(hist[i]))) / len(hist[i])
                              if hist[i] is not None else 0.0)
            assert got[i, j] == pytest.approx(want, abs=1e-12)
    r = rng.normal(size=4)
    rows = relative_rows(r + d, r, means)
    assert rows.dtype == np.float32
    np.testing.assert_allclose(rows, (r + got).astype(np.float32), atol=1e-6)


def test_relative_features_shape_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="means"):
        relative_features(np.zeros((2, 3)), [None])
    with pytest.raises(ValueError, match=r"means\[0\]"):
        relative_features(np.zeros((1, 3)), [np.zeros(2)])


def test_update_history_running_mean_and_resets() -> None:
    rng = np.random.default_rng(1)
    h = UpdateHistory()
    ups = rng.normal(size=(4, 5))
    for u in ups:
        h.observe(7, 0, u)
    np.testing.assert_allclose(h.mean(7, 0), ups.mean(axis=0), atol=1e-6)
    assert h.counts[7] == 4
    assert h.mean(7, 1) is None  # another cohort: no history there
    h.observe(7, 2, ups[0])  # moved to cohort 2: the old history is dropped
    np.testing.assert_allclose(h.mean(7, 2), ups[0], atol=1e-7)
    assert h.counts[7] == 1
    h.reset(7)
    assert h.mean(7, 2) is None and 7 not in h.counts
    with pytest.raises(ValueError, match="update"):
        h.observe(1, 0, np.array([np.nan]))
    h.observe(1, 0, np.zeros(5))
    with pytest.raises(ValueError, match="length"):
        h.observe(1, 0, np.zeros(4))


def test_update_history_survives_the_state_snapshot() -> None:
    state = ServerState.fresh([0, 1, 2], np.zeros(6, dtype=np.float32))
    h = UpdateHistory()
    h.observe(0, 0, np.arange(6.0))
    h.observe(0, 0, np.ones(6))
    h.observe(2, 0, -np.ones(6))
    state.update_history = h
    back = restore_files(snapshot_files(state), rounds_done=3).update_history
    assert back is not None and back.counts == {0: 2, 2: 1} and back.cohorts == {0: 0, 2: 0}
    np.testing.assert_array_equal(back.means[0], h.means[0])
    np.testing.assert_array_equal(back.means[2], h.means[2])
    assert "update_history.npz" not in snapshot_files(
        ServerState.fresh([0], np.zeros(2, dtype=np.float32)))


def skewed_families(seed: int, p: int = 5_000, per: int = 8, skew: float = 0.05,
                    drift: float = 0.01):
    """Each client's own stable update component (its label mix) N(m_i, 0.01) with
    m_i ~ U(-skew, skew), plus, at the drift, one of two opposite drift families
    N(+-drift, 0.003); ``per`` clients per family. Each client has 3 previous stable
    updates (its component + noise) and one drifted update."""
    rng = np.random.default_rng(seed)
    ref = rng.normal(0, 0.05, p)
    drifts = [rng.normal(s * drift, 0.003, p) for s in (1, -1)]
    prev, now, fam = [], [], []
    for f in range(2):
        for _ in range(per):
            own = rng.normal(rng.uniform(-skew, skew), 0.01, p)
            prev.append([own + rng.normal(0, 0.001, p) for _ in range(3)])
            now.append(own + drifts[f] + rng.normal(0, 0.001, p))
            fam.append(f)
    return ref, np.asarray(prev), np.asarray(now), fam


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_relative_features_separate_families_that_label_skew_hides(seed: int) -> None:
    ref, prev, now, fam = skewed_families(seed)
    ids = list(range(len(fam)))
    co = CLMACohorter(clusterer=AutoKMeans(random_state=0))
    paper = co.cohort(ids, (ref + now).astype(np.float32), ref.astype(np.float32))
    rows = relative_rows(ref + now, ref, list(prev.mean(axis=1)))
    rel = co.cohort(ids, rows, ref.astype(np.float32))
    # published features: each client's own component sets the KS sign and dominates
    # the PCA, so the cohorts do not follow the drift
    assert adjusted_rand_score(fam, paper.labels(ids)) < 0.3
    assert adjusted_rand_score(fam, rel.labels(ids)) == 1.0


class Recorder(Cohorter):
    def __init__(self) -> None:
        self.inputs: list[tuple[list, np.ndarray, np.ndarray]] = []

    def cohort(self, client_ids, matrix, reference) -> CohortAssignment:
        self.inputs.append((list(client_ids), np.array(matrix), np.array(reference)))
        return CohortAssignment({c: 0 for c in client_ids}, {c: 0.0 for c in client_ids})


def test_cohort_quarantined_feeds_relative_rows_and_averages_parameters() -> None:
    rng = np.random.default_rng(3)
    ref = rng.normal(size=5).astype(np.float32)
    x = {c: (ref + rng.normal(size=5)).astype(np.float32) for c in (0, 1, 2)}
    updates = [ClientUpdate(c, 0, x[c], 10, c != 2) for c in (0, 1, 2)]
    h = UpdateHistory()
    m0 = rng.normal(size=5)
    h.observe(0, 0, m0)  # client 1 has no history: keeps its published feature
    reg = CohortRegistry()
    reg.create_root([0, 1, 2], 0)
    rec = Recorder()
    models, out = cohort_quarantined(updates, [0, 1], {0: ref}, reg, rec, 4,
                                     start_models={0: ref}, history=h)
    ids, matrix, reference = rec.inputs[0]
    assert ids == [0, 1]
    np.testing.assert_allclose(matrix[0], ref + (x[0] - ref - m0), atol=1e-6)
    np.testing.assert_allclose(matrix[1], x[1], atol=1e-6)
    np.testing.assert_array_equal(reference, ref)
    (new_id,) = out.new_cohorts
    np.testing.assert_allclose(models[new_id], (x[0] + x[1]) / 2, atol=1e-6)


# ---------------------------------------------------------------- broken-stick components


def test_broken_stick_literal_expectation() -> None:
    from clma.cohort.projection import broken_stick_components

    r = 4
    b = [sum(1.0 / i for i in range(k, r + 1)) / r for k in range(1, r + 1)]
    assert b[0] == pytest.approx(25 / 48)  # (1 + 1/2 + 1/3 + 1/4) / 4
    eps = 1e-9
    # first share just above / at its expectation
    assert broken_stick_components(np.array([b[0] + eps, 0.3, 0.1, 0.1 - eps])) >= 1
    assert broken_stick_components(np.array([b[0], 0.3, 0.2, 1 - b[0] - 0.5])) == 0
    # stops at the first component below its expectation, even if a later one is above
    ratio = np.array([0.6, 0.2, 0.15, 0.05])  # b = 0.521, 0.271, 0.146, 0.0625
    assert broken_stick_components(ratio) == 1
    assert broken_stick_components(np.array([])) == 0


def test_broken_stick_keeps_the_family_split_variance_rule_drowns_it() -> None:
    """Two families whose split holds ~20 % of the variance among 28 clients of isotropic
    noise: 80 % of the variance needs many noise components (silhouette below the floor:
    one cohort); the broken stick keeps the split alone (two cohorts, ARI 1)."""
    rng = np.random.default_rng(5)
    p, per = 4_000, 14
    ref = rng.normal(0, 0.05, p)
    split = rng.normal(0, 1, p)
    split /= np.linalg.norm(split)
    rows, fam = [], []
    for f, sgn in enumerate((1, -1)):
        for _ in range(per):
            rows.append(ref + sgn * 1.2 * split + rng.normal(0, 1 / np.sqrt(p), p) * 2.4)
            fam.append(f)
    x = np.asarray(rows, dtype=np.float32)
    ids = list(range(len(fam)))
    base = dict(clusterer=AutoKMeans(random_state=0), variance_threshold=0.8)
    today = CLMACohorter(**base, direction_rule="none").cohort(ids, x, ref.astype(np.float32))
    better = CLMACohorter(**base, components="broken_stick", direction_rule="none").cohort(
        ids, x, ref.astype(np.float32))
    assert today.n_cohorts == 1
    assert adjusted_rand_score(fam, better.labels(ids)) == 1.0
    assert better.groups[0].n_components == 1


def test_broken_stick_one_family_stays_one_cohort() -> None:
    rng = np.random.default_rng(6)
    p = 4_000
    ref = rng.normal(0, 0.05, p)
    drift = rng.normal(0.01, 0.01, p)
    x = np.asarray([ref + drift + rng.normal(0, 0.01, p) for _ in range(15)], dtype=np.float32)
    res = CLMACohorter(clusterer=AutoKMeans(random_state=0), components="broken_stick",
                       direction_rule="none").cohort(list(range(15)), x,
                                                     ref.astype(np.float32))
    assert res.n_cohorts == 1
    assert res.groups[0].reason == "no component above the broken stick"
    assert set(res.directions.values()) == {"undirected"}


def test_new_cohorter_options_validated_by_name() -> None:
    with pytest.raises(ValueError, match="components"):
        CLMACohorter(components="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="direction_rule"):
        CLMACohorter(direction_rule="never")  # type: ignore[arg-type]


def test_config_selects_the_improved_cohorter() -> None:
    from clma.config import ConfigError, default_config, validate_config, with_cohort_method
    from clma.engine import make_cohorter

    data = default_config().model_dump()
    co = make_cohorter(default_config())  # the default method (issue 46)
    assert co.components == "broken_stick" and co.effective_direction_rule == "none"
    assert co.leading_split_alpha == 0.01
    paper = make_cohorter(validate_config(with_cohort_method(data, "paper")))
    assert paper.components == "variance" and paper.leading_split_alpha is None
    assert paper.effective_direction_rule == "established"  # "auto" with centering
    data["cohort"].update(components="broken_stick", direction_rule="none",
                          features="relative")
    co = make_cohorter(validate_config(data))
    assert co.components == "broken_stick" and co.effective_direction_rule == "none"
    data["cohort"]["components"] = "kaiser"
    with pytest.raises(ConfigError, match="components"):
        validate_config(data)


def test_engine_records_stable_updates_and_restarts_quarantined() -> None:
    from clma.config import default_config, validate_config
    from clma.engine import FederationEngine, RoundContext

    data = default_config().model_dump()
    data["cohort"]["features"] = "relative"
    eng = FederationEngine.__new__(FederationEngine)  # the step only needs these three
    eng.config = validate_config(data)
    eng.state = ServerState.fresh([0, 1], np.zeros(3, dtype=np.float32))
    eng._selector = lambda v: v
    start = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    for r, (x0, x1) in enumerate([([2, 2, 3], [1, 1, 1]), ([1, 4, 3], [0, 0, 0])], start=1):
        ctx = RoundContext(r, [0, 1], {0: 0, 1: 0}, {0: start})
        ctx.updates = [ClientUpdate(0, 0, np.array(x0, np.float32), 5, False),
                       ClientUpdate(1, 0, np.array(x1, np.float32), 5, r == 2)]
        ctx.quarantined = [1] if r == 2 else []
        eng.record_history(ctx)
    h = eng.state.update_history
    np.testing.assert_allclose(h.mean(0, 0), ([1, 0, 0] + np.array([0, 2, 0])) / 2)
    assert h.counts[0] == 2 and h.mean(1, 0) is None  # quarantined in round 2: restarted
    data["cohort"]["features"] = "paper"
    eng.config, eng.state.update_history = validate_config(data), None
    eng.record_history(ctx)
    assert eng.state.update_history is None  # paper features keep no history
