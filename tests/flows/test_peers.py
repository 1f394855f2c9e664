"""The clustered-FL baselines of the experiment harness (flows/experiments/peers.py):
CFL's cosine bi-partition against a hand-computed example and a brute force, and both
baselines on a toy federation whose answer is known (two groups of clients with opposite
label rotations from the first round: CFL splits them, IFCA gives them different
models)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from clma.config import validate_config
from clma.sim.truth import drift_event_ari
from flows.experiments.clma_vs_fedavg import MethodRun
from flows.experiments.peers import (
    PeerRun,
    cosine_bipartition,
    cosine_similarity_matrix,
    ifca_default_k,
    run_cfl,
    run_ifca,
)

# ----------------------------------------------------------------------------- kernel


def test_cosine_similarity_matrix_is_the_literal_formula():
    u = np.array([[3.0, 4.0], [4.0, 3.0], [0.0, 0.0], [-3.0, -4.0]])
    a = cosine_similarity_matrix(u)
    assert a[0, 1] == pytest.approx(24 / 25)
    assert a[0, 3] == pytest.approx(-1.0)
    assert a[0, 2] == 0.0 and a[2, 2] == 1.0  # a zero update: similarity 0 with others
    np.testing.assert_allclose(a, a.T)
    with pytest.raises(ValueError, match="updates: must be finite"):
        cosine_similarity_matrix(np.array([[1.0, np.nan]]))


def test_cosine_bipartition_of_a_hand_computed_example():
    # u0 = (1, 0), u1 = (1, 1), u2 = (-1, 1), u3 = (-1, 0):
    # alpha01 = alpha23 = 1/sqrt2, alpha12 = 0, alpha02 = alpha13 = -1/sqrt2, alpha03 = -1.
    # {0,1} | {2,3} has the smallest largest cross similarity (alpha12 = 0); every other
    # split puts a pair of similarity 1/sqrt2 across.
    u = np.array([[1.0, 0.0], [1.0, 1.0], [-1.0, 1.0], [-1.0, 0.0]])
    bp = cosine_bipartition(cosine_similarity_matrix(u))
    assert (bp.first, bp.second) == ((0, 1), (2, 3))
    assert bp.alpha_cross_max == pytest.approx(0.0, abs=1e-12)
    assert bp.alpha_intra_min == pytest.approx(1 / math.sqrt(2))


@pytest.mark.parametrize("seed", range(5))
def test_cosine_bipartition_minimises_the_largest_cross_similarity(seed):
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(7, 5))
    a = cosine_similarity_matrix(u)
    best = min(
        a[np.ix_(part, [j for j in range(7) if j not in part])].max()
        for r in range(1, 7) for part in map(list, itertools.combinations(range(7), r))
    )
    bp = cosine_bipartition(a)
    assert sorted(bp.first + bp.second) == list(range(7)) and bp.first and bp.second
    assert bp.alpha_cross_max == pytest.approx(best, abs=1e-12)


def test_cosine_bipartition_refuses_bad_input():
    with pytest.raises(ValueError, match="at least 2 clients"):
        cosine_bipartition(np.ones((1, 1)))
    with pytest.raises(ValueError, match="square"):
        cosine_bipartition(np.ones((2, 3)))


def test_ifca_default_k_counts_ground_truth_groups():
    ev = [{"round": 2, "kind": "label_rotation", "shift": 1, "family": "a", "clients": [0]},
          {"round": 2, "kind": "label_rotation", "shift": -1, "family": "b", "clients": [1]},
          {"round": 3, "kind": "label_rotation", "shift": 1, "family": "a", "clients": [0]}]
    assert ifca_default_k(validate_config({"clients": 3, "drift": {"events": ev}})) == 3
    assert ifca_default_k(validate_config({"clients": 2, "drift": {"events": ev}})) == 2


# ----------------------------------------------------------------------------- toy runs

GROUP_A, GROUP_B = [0, 2, 4], [1, 3, 5]


def _toy():
    """6 clients on digits, labels rotated +3 (A) and -3 (B) from round 1 on, 3 rounds."""
    return validate_config({
        "name": "toy-peers", "seed": 0, "rounds": 3, "clients": 6,
        "training": {"local_epochs": 2, "learning_rate": 0.3, "batch_size": 16},
        "drift": {"events": [
            {"round": 1, "kind": "label_rotation", "shift": 3, "family": "A",
             "clients": GROUP_A},
            {"round": 1, "kind": "label_rotation", "shift": -3, "family": "B",
             "clients": GROUP_B}]},
    })


@pytest.fixture(scope="module")
def cfl_run() -> PeerRun:
    # round 1's updates: weighted mean norm 0.80 (< eps1), largest 1.35 (> eps2)
    return run_cfl(_toy(), 0, eps1=1.0, eps2=1.0, warmup_rounds=0)


@pytest.fixture(scope="module")
def ifca_run() -> PeerRun:
    return run_ifca(_toy(), 0, k=2)


def _separates(assignment):
    a = {assignment[c] for c in GROUP_A}
    b = {assignment[c] for c in GROUP_B}
    return len(a) == 1 and len(b) == 1 and a != b


def test_cfl_splits_the_two_opposite_groups(cfl_run):
    first = cfl_run.details["splits"][0]
    assert first["round"] == 1 and first["sizes"] == [3, 3]
    assert first["mean_update_norm"] < 1.0 < first["max_update_norm"]
    assert _separates(cfl_run.assignment_history[1])
    assert cfl_run.ari_per_drift_event == {"1": 1.0}
    assert cfl_run.families_separated_every_event is True
    # the split's criteria stop it there: later rounds' mean norms are above eps1
    later = [n for n in cfl_run.details["norms"] if n["round"] > 1]
    assert len(cfl_run.details["splits"]) == 1 and all(n["mean_update_norm"] >= 1.0
                                                       for n in later)
    assert _separates(cfl_run.assignment_history[3])


def test_cfl_without_a_split_is_fedavg_and_so_is_ifca_with_one_model(ifca_run):
    cfg = _toy()
    never = run_cfl(cfg, 0, eps1=1e-9, eps2=1e9)
    one = run_ifca(cfg, 0, k=1)
    assert never.details["splits"] == [] and never.ari_per_drift_event == {"1": 0.0}
    assert never.assignment_history == one.assignment_history
    assert never.drifted_final_accuracy == one.drifted_final_accuracy
    # one model for two opposite label rotations fits neither; two models fit both
    assert ifca_run.drifted_final_accuracy > never.drifted_final_accuracy + 0.2


def test_ifca_gives_the_two_groups_different_models(ifca_run):
    assert ifca_run.details["k"] == 2 and ifca_run.details["models_chosen_last_round"] == 2
    for r in (2, 3):
        assert _separates(ifca_run.assignment_history[r])
    # the reported ARI is the drift round's (round 1: both models still untrained)
    a1 = ifca_run.assignment_history[1]
    fams = {c: ("A" if c in GROUP_A else "B") for c in a1}
    assert ifca_run.ari_per_drift_event == {"1": drift_event_ari(fams, a1)}


def test_peer_run_carries_the_method_run_fields(ifca_run):
    m = ifca_run.to_method_run()
    assert isinstance(m, MethodRun) and m.method == "ifca" and m.seed == 0
    assert set(MethodRun.__dataclass_fields__) <= set(PeerRun.__dataclass_fields__)
    assert m.stationary_final_accuracy is None  # every toy client drifts
    assert 0.0 <= m.drifted_final_accuracy <= 1.0


def test_bad_baseline_arguments_are_refused():
    with pytest.raises(ValueError, match="eps1, eps2"):
        run_cfl(_toy(), 0, eps1=0.0)
    with pytest.raises(ValueError, match="min_cluster_size"):
        run_cfl(_toy(), 0, min_cluster_size=1)
    with pytest.raises(ValueError, match="k: must be an integer >= 1"):
        run_ifca(_toy(), 0, k=0)
