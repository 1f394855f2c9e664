"""clma.sim.truth: ARI of cohorts against injected families; separation check."""

from __future__ import annotations

import pytest
from sklearn.metrics import adjusted_rand_score

from clma.sim.truth import drift_event_ari, families_separated, mean_or_none

CASES = [
    # families, cohorts, expected ARI (hand-computed)
    ({0: "p", 1: "p", 2: "m", 3: "m"}, {0: 5, 1: 5, 2: 6, 3: 6}, 1.0),
    ({0: "p", 1: "p", 2: "m", 3: "m"}, {0: 9, 1: 9, 2: 9, 3: 9}, 0.0),
    ({0: "p", 1: "p", 2: "m", 3: "m"}, {0: 1, 1: 2, 2: 1, 3: 2}, -0.5),
    ({0: "p", 1: "p", 2: "m", 3: "m"}, {0: 1, 1: 2, 2: 3, 3: 3}, 4 / 7),
    ({0: "p", 1: "p", 2: "p"}, {0: 1, 1: 1, 2: 1}, 1.0),
    ({0: "p", 1: "p", 2: "p"}, {0: 1, 1: 1, 2: 2}, 0.0),
]


@pytest.mark.parametrize(("families", "cohorts", "expected"), CASES)
def test_ari_hand_cases_and_sklearn(families, cohorts, expected):
    ids = sorted(families)
    got = drift_event_ari(families, cohorts)
    assert got == pytest.approx(expected, abs=1e-12)
    assert got == pytest.approx(adjusted_rand_score([families[c] for c in ids],
                                                    [cohorts[c] for c in ids]), abs=1e-12)


def test_ari_ignores_clients_outside_the_event_and_errors():
    fam = {4: "p", 7: "m"}
    cohorts = {4: 1, 7: 2, 9: 1, 11: 2}
    assert drift_event_ari(fam, cohorts) == 1.0
    with pytest.raises(ValueError, match="no drifted clients"):
        drift_event_ari({}, cohorts)
    with pytest.raises(ValueError, match="has no cohort"):
        drift_event_ari({4: "p", 5: "m"}, cohorts)


def test_families_separated():
    fam = {0: "p", 1: "p", 2: "m", 3: "m"}
    assert families_separated(fam, {0: 1, 1: 1, 2: 2, 3: 2})
    # a family split over two cohorts is still separated (no cohort mixes families)
    assert families_separated(fam, {0: 1, 1: 3, 2: 2, 3: 2})
    assert not families_separated(fam, {0: 1, 1: 2, 2: 2, 3: 2})
    assert not families_separated(fam, dict.fromkeys(range(4), 0))
    assert families_separated({}, {})


def test_mean_or_none():
    assert mean_or_none([]) is None
    assert mean_or_none([0.5, 1.0]) == 0.75
